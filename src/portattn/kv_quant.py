"""Quantised (fp8) KV caches: the dtypes, and the one saturating write and dequantising read.

An fp8 cache stores each value ``x`` as ``q = saturate(x / scale)`` in ``float8_e4m3fn`` or
``float8_e5m2``; the value a reader sees is ``q * scale``. ``scale`` is one float per layer and per
tensor (K, V, or the MLA latent row), 1.0 when the checkpoint has none. Saturation clamps to the
dtype's largest finite value (448 for e4m3, 57344 for e5m2): a plain cast would turn an
out-of-range value into NaN (e4m3) or infinity (e5m2). NaN stays NaN.

Queries stay in the model's dtype; kernels dequantise K and V in registers, folding the K scale
into the softmax scale and the V scale into the output.
"""

from __future__ import annotations

import math

import torch

from .errors import expect

# Engine names (``EngineConfig.kv_cache_dtype``) -> cache dtypes; "auto" is the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,  # (vLLM's name for e4m3)
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the KV cache dtypes that hold scaled values (fp8)."""
    return dtype in FP8_DTYPES


def resolve_kv_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """``"auto"`` -> ``model_dtype``; ``"fp8_e4m3"`` (or ``"fp8"``, vLLM's name for it) / ``"fp8_e5m2"`` (or their
    torch dtypes) -> fp8."""
    if isinstance(name, torch.dtype):
        expect(name == model_dtype or name in FP8_DTYPES, f"kv_cache_dtype {model_dtype} or an fp8 dtype", name)
        return name
    expect(name in KV_CACHE_DTYPES, f"kv_cache_dtype in {list(KV_CACHE_DTYPES)}", repr(name))
    return KV_CACHE_DTYPES[name] or model_dtype


def check_scale(name: str, scale: object) -> float:
    """A KV scale: a positive finite Python number (one per layer; 1.0 = none)."""
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
    expect(ok, f"{name} to be a positive finite float", scale)
    return float(scale)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: ``saturate(x / scale)`` for fp8, ``x`` cast otherwise
    (``scale`` must then be 1.0).

    The division runs in float32 (float64 for float64 inputs); NaN stays NaN.
    """
    if dtype not in FP8_DTYPES:
        expect(scale == 1.0, f"scale 1.0 for a {dtype} cache (scales apply to fp8 caches)", scale)
        return x.to(dtype)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    limit = torch.finfo(dtype).max
    y = x.to(acc) if scale == 1.0 else x.to(acc) / scale
    return y.clamp(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What a reader sees of cache values ``x``: ``x * scale`` in ``dtype`` (exact for fp8 in float32)."""
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale
