"""The cases of ``portattn check``: batch shapes, features, fp8 and MLA fixtures, and one case's errors.

Every case builds its inputs from the ops' poisoned fixtures (``portattn.testing``: shuffled pages, NaN
in every slot no sequence owns) with a seed that depends on the case alone (:func:`case_seed`), runs
the public op on the backend under test and compares with the float64 reference; the tolerance is a
small multiple of what the reference's own arithmetic in the same dtype loses (``testing.tolerance``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import ops, testing
from ..cascade import merge_attention_states
from ..kv_quant import KV_CACHE_DTYPES, dequantize_kv, quantize_kv
from ..mla import mla_decode

PAGE_SIZES = (1, 3, 7, 16, 64)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
K_SCALE, V_SCALE = 0.25, 0.0625  # fp8 cases: stored K is 4x the key, stored V 16x the value


def mixed_batch(p: int) -> tuple[list[int], list[int]]:
    """Decodes at lengths 1, P-1, P, P+1, an extend over a prefix and a full prefill."""
    return [1, 1, p, 2, min(5, 3 * p + 2), 2 * p + 5], [1, max(p - 1, 1), p, p + 1, 3 * p + 2, 2 * p + 5]


def long_decodes(p: int) -> tuple[list[int], list[int]]:
    """Few long decodes: backends that split keys over programs (split-KV) do, then merge the splits."""
    return [1, 1, 1], [2100, 1030, p + 1]


def mla_batch(p: int) -> tuple[list[int], list[int]]:
    return [1] * 6, [1, max(p - 1, 1), p, p + 1, 3 * p + 2, 0]  # a sequence without keys returns zeros


def mla_long(p: int) -> tuple[list[int], list[int]]:
    return [1] * 3, [1600, 700, p + 1]


def varlen_batch(p: int) -> tuple[list[int], list[int]]:
    """Self-attention sequences, and one cross-attention sequence with fewer queries than keys."""
    return [1, 7, 16, 17, 40, 9], [1, 7, 16, 17, 40, 33]


def _sinks(dtype: torch.dtype, device: torch.device, heads: int = 8) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, heads).to(dtype=dtype, device=device)


def _slopes(dtype: torch.dtype, device: torch.device, heads: int = 8) -> torch.Tensor:
    return torch.tensor([2.0 ** -(i + 1) for i in range(heads)], device=device)


def _none(dtype: torch.dtype, device: torch.device) -> dict:
    return {}


@dataclass(frozen=True)
class Feature:
    """One row of the check: an op on a batch shape, with keyword arguments and cache format.

    ``mla_decode``: ``head_dim`` is ``kv_lora_rank``, ``value_dim`` the rope dim, ``num_q_heads``
    the heads. ``kv_cache``: ``"fp8_e4m3"`` / ``"fp8_e5m2"`` stores the cache in fp8 at ``K_SCALE``
    / ``V_SCALE`` (MLA: ``K_SCALE``) and compares with the reference on the dequantised cache.
    """

    name: str
    op: str  # "paged_attention", "varlen_attention", "mla_decode" or "merge_attention_states"
    kwargs: Callable[[torch.dtype, torch.device], dict] = _none
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    value_dim: int | None = None
    kv_cache: str | None = None
    lens: Callable[[int], tuple[list[int], list[int]]] = mixed_batch


FEATURES = [
    Feature("mixed batch (D 64)", "paged_attention"),
    Feature("mha (Hq = Hkv)", "paged_attention", num_q_heads=4, num_kv_heads=4),
    Feature("mqa (Hkv = 1)", "paged_attention", num_kv_heads=1),
    *(Feature(f"head dim {d}", "paged_attention", head_dim=d) for d in (40, 72, 80, 96, 128, 192, 256)),
    Feature("head dims 224 / Dv 112", "paged_attention", head_dim=224, value_dim=112),
    Feature("Dv != D", "paged_attention", value_dim=32),
    Feature("window_left 5", "paged_attention", lambda dt, dev: {"window_left": 5}),
    Feature("chunk 8", "paged_attention", lambda dt, dev: {"attention_chunk_size": 8}),
    Feature("sinks", "paged_attention", lambda dt, dev: {"sinks": _sinks(dt, dev)}),
    Feature("softcap 5", "paged_attention", lambda dt, dev: {"logit_softcap": 5.0}),
    Feature("non-causal", "paged_attention", lambda dt, dev: {"causal": False}),
    # The combinations the model families use: gpt-oss (sinks on sliding-window layers, head dim 64)
    # and Gemma 2 (softcap on sliding-window layers, head dim 256).
    Feature("sinks + window (D 64)", "paged_attention", lambda dt, dev: {"window_left": 5, "sinks": _sinks(dt, dev)}),
    Feature(
        "softcap + window (D 256)",
        "paged_attention",
        lambda dt, dev: {"window_left": 5, "logit_softcap": 5.0},
        head_dim=256,
    ),
    Feature(
        "window_right (3, 2)", "paged_attention", lambda dt, dev: {"causal": False, "window_left": 3, "window_right": 2}
    ),
    Feature("alibi", "paged_attention", lambda dt, dev: {"alibi_slopes": _slopes(dt, dev)}),
    Feature(
        "alibi + window + softcap",
        "paged_attention",
        lambda dt, dev: {"alibi_slopes": _slopes(dt, dev), "window_left": 5, "logit_softcap": 5.0},
    ),
    Feature("return_lse + sinks", "paged_attention", lambda dt, dev: {"sinks": _sinks(dt, dev), "return_lse": True}),
    Feature("long decode (split-KV)", "paged_attention", lens=long_decodes),
    Feature(
        "long decode + sinks + lse",
        "paged_attention",
        lambda dt, dev: {"sinks": _sinks(dt, dev), "return_lse": True},
        lens=long_decodes,
    ),
    Feature("fp8 e4m3 cache", "paged_attention", kv_cache="fp8_e4m3"),
    Feature("fp8 e5m2 cache", "paged_attention", kv_cache="fp8_e5m2"),
    Feature(
        "fp8 e4m3 + window + sinks",
        "paged_attention",
        lambda dt, dev: {"window_left": 5, "sinks": _sinks(dt, dev)},
        kv_cache="fp8_e4m3",
    ),
    Feature("fp8 e4m3 head dim 128", "paged_attention", head_dim=128, kv_cache="fp8_e4m3"),
    Feature("fp8 e5m2 long decode", "paged_attention", kv_cache="fp8_e5m2", lens=long_decodes),
    Feature("varlen non-causal", "varlen_attention", lens=varlen_batch),
    Feature("varlen causal", "varlen_attention", lambda dt, dev: {"causal": True}, lens=varlen_batch),
    Feature("varlen window (8, 8)", "varlen_attention", lambda dt, dev: {"window_size": (8, 8)}, lens=varlen_batch),
    Feature(
        "varlen window + sinks",
        "varlen_attention",
        lambda dt, dev: {"window_size": (8, 8), "sinks": _sinks(dt, dev)},
        head_dim=80,
        lens=varlen_batch,
    ),
    Feature(
        "varlen alibi + window",
        "varlen_attention",
        lambda dt, dev: {"alibi_slopes": _slopes(dt, dev), "window_size": (8, 4)},
        lens=varlen_batch,
    ),
    Feature(
        "varlen return_lse", "varlen_attention", lambda dt, dev: {"causal": True, "return_lse": True}, lens=varlen_batch
    ),
    Feature("MLA 512 + 64, H 16", "mla_decode", num_q_heads=16, head_dim=512, value_dim=64, lens=mla_batch),
    Feature("MLA long (split-KV)", "mla_decode", num_q_heads=16, head_dim=512, value_dim=64, lens=mla_long),
    Feature("MLA 32 + 16, H 5", "mla_decode", num_q_heads=5, head_dim=32, value_dim=16, lens=mla_batch),
    Feature(
        "MLA fp8 e4m3", "mla_decode", num_q_heads=16, head_dim=512, value_dim=64, kv_cache="fp8_e4m3", lens=mla_batch
    ),
    Feature(
        "MLA fp8 e5m2", "mla_decode", num_q_heads=16, head_dim=512, value_dim=64, kv_cache="fp8_e5m2", lens=mla_batch
    ),
    Feature("merge 3 parts", "merge_attention_states", lens=varlen_batch),
]
CASE_NAMES = [f.name for f in FEATURES]


def case_tags(feature: Feature) -> frozenset[str]:
    """What a case exercises, in the words ``--require`` takes: its op, the capability features its
    arguments need (``window``, ``sinks``, ... as backends declare them) and an fp8 cache format."""
    kwargs = feature.kwargs(torch.float32, torch.device("cpu"))
    tags = {feature.op}
    if feature.op == "mla_decode":
        tags.add("lse")  # every MLA case also compares the log-sum-exp
    elif feature.op != "merge_attention_states":
        default_causal = feature.op == "paged_attention"
        checks = {
            "window": any(k in kwargs for k in ("window_left", "window_right", "window_size")),
            "chunk": "attention_chunk_size" in kwargs,
            "sinks": "sinks" in kwargs,
            "softcap": kwargs.get("logit_softcap", 0) > 0,
            "non_causal": not kwargs.get("causal", default_causal),
            "dv_ne_d": feature.value_dim not in (None, feature.head_dim),
            "lse": bool(kwargs.get("return_lse")),
            "alibi": "alibi_slopes" in kwargs,
        }
        tags |= {name for name, used in checks.items() if used}
    if feature.kv_cache is not None:
        tags.add(feature.kv_cache)
    return frozenset(tags)


REQUIREMENTS = sorted(set().union(*(case_tags(f) for f in FEATURES)))
assert len(set(CASE_NAMES)) == len(CASE_NAMES), "case names are how a failure is rerun: keep them unique"
# Varlen and merge cases gather the paged fixture (page size 16) into contiguous sequences.
CONTIGUOUS_LAYOUT = (16,)


def case_seed(feature: Feature, page_size: int) -> int:
    """The fixture's seed: a function of the case alone, so that a rerun of one case sees the same numbers."""
    return zlib.crc32(feature.name.encode()) % 10_000 + page_size


def _kv_dtype(feature: Feature) -> torch.dtype | None:
    return None if feature.kv_cache is None else KV_CACHE_DTYPES[feature.kv_cache]


def _pair(out, ref, lowp, dtype) -> tuple[float, float]:
    return testing.max_error(out, ref), testing.tolerance(ref, lowp, dtype)


def _lse_pair(lse, ref_lse, dtype) -> tuple[float, float]:
    """LSE error and tolerance (``testing.lse_error`` / ``lse_tolerance``): -inf rows must match."""
    return testing.lse_error(lse, ref_lse), testing.lse_tolerance(ref_lse, dtype)


def run_case(feature: Feature, backend: str, dtype: torch.dtype, page_size: int, device) -> list[tuple[float, float]]:
    """``(max error, tolerance)`` of each output of one case (the attention output, then the LSE if asked)."""
    kwargs = feature.kwargs(dtype, device)
    q_lens, k_lens = feature.lens(page_size)
    seed = case_seed(feature, page_size)
    kv_dtype = _kv_dtype(feature)
    if feature.op == "mla_decode":
        return _run_mla(feature, backend, dtype, page_size, device, seed, k_lens)
    case = testing.make_paged_case(
        q_lens,
        k_lens,
        page_size=page_size,
        num_q_heads=feature.num_q_heads,
        num_kv_heads=feature.num_kv_heads,
        head_dim=feature.head_dim,
        value_dim=feature.value_dim,
        dtype=dtype if kv_dtype is None else torch.float32,
        device=device,
        seed=seed,
    )
    if feature.op == "paged_attention":
        inputs, scales = case.inputs(), {}
        ref_inputs = inputs
        if kv_dtype is not None:
            inputs |= {
                "q": case.q.to(dtype),
                "k_cache": quantize_kv(case.k_cache, kv_dtype, K_SCALE),
                "v_cache": quantize_kv(case.v_cache, kv_dtype, V_SCALE),
            }
            scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}
            ref_inputs = inputs | {
                "k_cache": dequantize_kv(inputs["k_cache"], K_SCALE, torch.float64),
                "v_cache": dequantize_kv(inputs["v_cache"], V_SCALE, torch.float64),
            }
        got = ops.paged_attention(**inputs, backend=backend, **scales, **kwargs)
        ref = testing.paged_attention_ref(**ref_inputs, **kwargs)
        lowp = testing.paged_attention_ref(**ref_inputs, upcast=False, **kwargs)
    else:  # varlen and merge: the same sequences laid out contiguously
        k = torch.cat([testing.gather_sequence(case.k_cache, case.page_table[b], n) for b, n in enumerate(k_lens)])
        v = torch.cat([testing.gather_sequence(case.v_cache, case.page_table[b], n) for b, n in enumerate(k_lens)])
        args = (case.q, k, v, case.cu_seqlens_q, testing.cu_seqlens(k_lens, device))
        if feature.op == "merge_attention_states":
            return [_run_merge(args, backend, dtype)]
        got = ops.varlen_attention(*args, backend=backend, **kwargs)
        ref = testing.varlen_attention_ref(*args, **kwargs)
        lowp = testing.varlen_attention_ref(*args, upcast=False, **kwargs)
    if kwargs.get("return_lse"):
        return [_pair(got[0], ref[0], lowp[0], dtype), _lse_pair(got[1], ref[1], dtype)]
    return [_pair(got, ref, lowp, dtype)]


def _run_mla(feature, backend, dtype, page_size, device, seed, seq_lens) -> list[tuple[float, float]]:
    rank, rope = feature.head_dim, feature.value_dim
    kv_dtype = _kv_dtype(feature)
    # The latent cache as a one-head paged K cache: the same shuffled pages and NaN poison.
    case = testing.make_paged_case(
        [min(n, 1) for n in seq_lens],
        seq_lens,
        page_size=page_size,
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=rank + rope,
        dtype=torch.float32,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(seq_lens), feature.num_q_heads, rank + rope, generator=gen).to(device, dtype)
    q_nope, q_rope = q[..., :rank].contiguous(), q[..., rank:].contiguous()
    cache = case.k_cache[:, :, 0].to(device)  # [N, P, R + Dr]
    scale, extra = (rank + rope) ** -0.5, {}
    if kv_dtype is None:
        cache = cache.to(dtype)
        ref_cache = cache
    else:
        cache = quantize_kv(cache, kv_dtype, K_SCALE)
        ref_cache, extra = dequantize_kv(cache, K_SCALE, torch.float64), {"kv_scale": K_SCALE}
    table, lens = case.page_table.to(device), case.seq_lens_k.to(device)
    out, lse = mla_decode(q_nope, q_rope, cache, table, lens, scale=scale, backend=backend, return_lse=True, **extra)
    ref, ref_lse = testing.mla_decode_ref(q_nope, q_rope, ref_cache, table, lens, scale=scale, return_lse=True)
    lowp = testing.mla_decode_ref(q_nope, q_rope, ref_cache, table, lens, scale=scale, upcast=False)
    return [_pair(out, ref, lowp, dtype), _lse_pair(lse, ref_lse, dtype)]


def _run_merge(args, backend: str, dtype: torch.dtype) -> tuple[float, float]:
    """Each sequence's keys cut in three ranges (one may be empty), attended by the reference, merged."""
    q, k, v, cu_q, cu_k = args
    k_lens = (cu_k[1:] - cu_k[:-1]).tolist()
    parts = []
    for part in range(3):
        lo = [n * part // 3 for n in k_lens]
        hi = [n * (part + 1) // 3 for n in k_lens]
        starts = cu_k[:-1].tolist()
        rows = torch.cat([torch.arange(s + a, s + b, device=q.device) for s, a, b in zip(starts, lo, hi)])
        cu = testing.cu_seqlens([b - a for a, b in zip(lo, hi)], q.device)
        parts.append(testing.varlen_attention_ref(q, k[rows], v[rows], cu_q, cu, return_lse=True))
    merged_args = [t for out, lse in parts for t in (out.to(dtype), lse.float())]
    got, _ = merge_attention_states(*merged_args, backend=backend)
    ref = testing.varlen_attention_ref(q, k, v, cu_q, cu_k)
    # The same merge in float64 from the rounded parts, rounded once: what good arithmetic gets.
    lses = torch.stack([lse.float().double() for _, lse in parts])  # [3, T, H]
    weights = torch.softmax(lses, dim=0).nan_to_num(0.0)
    lowp = sum(w[..., None] * out.to(dtype).double() for w, (out, _) in zip(weights, parts)).to(dtype)
    return _pair(got, ref, lowp, dtype)


def describe_case(feature: Feature, dtype_name: str, page_size: int, device) -> dict:
    """Everything that fixes one case's numbers (its inputs follow from these and :func:`case_seed`)."""
    dtype = DTYPES[dtype_name]
    q_lens, k_lens = feature.lens(page_size)
    kwargs = {name: _short(value) for name, value in feature.kwargs(dtype, device).items()}
    shape = {"num_q_heads": feature.num_q_heads, "num_kv_heads": feature.num_kv_heads}
    shape |= {"head_dim": feature.head_dim, "value_dim": feature.value_dim or feature.head_dim}
    if feature.op == "mla_decode":
        shape = {"num_heads": feature.num_q_heads, "kv_lora_rank": feature.head_dim, "rope_dim": feature.value_dim}
        q_lens = None
    cache = feature.kv_cache or dtype_name
    if feature.kv_cache:
        cache += f" (k_scale {K_SCALE}, v_scale {V_SCALE})" if feature.op != "mla_decode" else f" (kv_scale {K_SCALE})"
    return {
        "op": feature.op,
        "page_size": page_size if feature.op in ("paged_attention", "mla_decode") else None,
        "dtype": dtype_name,
        "q_lens": q_lens,
        "k_lens": k_lens,
        **shape,
        "kv_cache": cache,
        "kwargs": kwargs,
        "seed": case_seed(feature, page_size),
    }


def _short(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} {value.flatten()[:4].tolist()}"
    return value
