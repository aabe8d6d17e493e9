"""Weight quantizations the engine offers (``quantization=``) and where they run; the layers that compute
them live in :mod:`portattn.models.layers.fp8_linear`."""

from __future__ import annotations

import torch

QUANTIZATIONS = ("fp8",)
# Model dtypes the fp8 matmul writes its output in.
FP8_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
    """Raise ``ValueError`` unless ``quantization`` is None or one of :data:`QUANTIZATIONS` for ``dtype`` (and,
    given, ``device``: the CPU, or an NVIDIA GPU whose tensor cores multiply float8 e4m3, compute capability
    8.9 on: Ada, Hopper, Blackwell; AMD's fp8 formats and other devices' fp8 matmuls are not wired up)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"expected quantization None or one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if dtype not in FP8_OUT_DTYPES:
        names = [str(d).removeprefix("torch.") for d in FP8_OUT_DTYPES]
        raise ValueError(f"expected a dtype in {names} with quantization {quantization!r}, got {dtype}")
    device = None if device is None else torch.device(device)
    if device is None or device.type == "cpu":
        return
    if device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9):
        return
    what = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    raise ValueError(
        f"expected the CPU or an NVIDIA GPU of compute capability 8.9 or newer (fp8 tensor cores: Ada, Hopper, "
        f"Blackwell) for quantization {quantization!r}, got {what}"
    )
