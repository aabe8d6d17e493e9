"""``portattn check``: every backend on this device against the float64 reference.

Runs a grid of features x page sizes x dtypes for each registered backend that runs here, prints a
table (one row per op, feature, backend and dtype; the error is the worst over page sizes) and
returns 1 if any case fails.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import ops, testing
from .backends.registry import available_backends
from .device import default_device, is_triton_interpreter
from .errors import UnsupportedFeatureError

PAGE_SIZES = (1, 3, 7, 16, 64)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Feature:
    name: str
    op: str  # "paged_attention" or "varlen_attention"
    kwargs: Callable[[torch.dtype, torch.device], dict]
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    value_dim: int | None = None


def _sinks(dtype: torch.dtype, device: torch.device, heads: int = 8) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, heads).to(dtype=dtype, device=device)


def _slopes(device: torch.device, heads: int = 8) -> torch.Tensor:
    """ALiBi slopes as BLOOM builds them for 8 heads: 2^-1, 2^-2, ..., 2^-8."""
    return torch.tensor([2.0 ** -(h + 1) for h in range(heads)], device=device)


FEATURES = [
    Feature("causal", "paged_attention", lambda dt, dev: {}),
    Feature("mha (Hq = Hkv)", "paged_attention", lambda dt, dev: {}, num_q_heads=4, num_kv_heads=4),
    Feature("mqa (Hkv = 1)", "paged_attention", lambda dt, dev: {}, num_kv_heads=1),
    Feature("head dim 80", "paged_attention", lambda dt, dev: {}, head_dim=80),
    Feature("head dim 128", "paged_attention", lambda dt, dev: {}, head_dim=128),
    Feature("head dim 40", "paged_attention", lambda dt, dev: {}, head_dim=40),
    Feature("head dims 224 / Dv 112", "paged_attention", lambda dt, dev: {}, head_dim=224, value_dim=112),
    Feature("Dv != D", "paged_attention", lambda dt, dev: {}, value_dim=32),
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
    Feature("alibi", "paged_attention", lambda dt, dev: {"alibi_slopes": _slopes(dev)}),
    Feature(
        "alibi + window + softcap",
        "paged_attention",
        lambda dt, dev: {"alibi_slopes": _slopes(dev), "window_left": 5, "logit_softcap": 5.0},
    ),
    Feature("return_lse + sinks", "paged_attention", lambda dt, dev: {"sinks": _sinks(dt, dev), "return_lse": True}),
    Feature("varlen non-causal", "varlen_attention", lambda dt, dev: {}),
    Feature("varlen causal", "varlen_attention", lambda dt, dev: {"causal": True}),
    Feature("varlen window (8, 8)", "varlen_attention", lambda dt, dev: {"window_size": (8, 8)}),
    Feature(
        "varlen window + sinks",
        "varlen_attention",
        lambda dt, dev: {"window_size": (8, 8), "sinks": _sinks(dt, dev)},
        head_dim=80,
    ),
    Feature(
        "varlen alibi + window",
        "varlen_attention",
        lambda dt, dev: {"alibi_slopes": _slopes(dev), "window_size": (8, 4)},
    ),
    Feature("varlen return_lse", "varlen_attention", lambda dt, dev: {"causal": True, "return_lse": True}),
]


def _paged_lens(page_size: int) -> tuple[list[int], list[int]]:
    """A mixed batch: decodes, an extend over a prefix, a full prefill; lengths 1, P-1, P, P+1."""
    p = page_size
    k_lens = [1, max(p - 1, 1), p, p + 1, 3 * p + 2, 2 * p + 5]
    q_lens = [1, 1, p, 2, min(5, 3 * p + 2), 2 * p + 5]
    return q_lens, k_lens


# Varlen cases reuse the paged fixture (page size 16) and gather the sequences contiguously.
VARLEN_LAYOUTS = (16,)


def _run_case(feature: Feature, backend: str, dtype: torch.dtype, page_size: int, device, seed: int):
    kwargs = feature.kwargs(dtype, device)
    if feature.op == "paged_attention":
        q_lens, k_lens = _paged_lens(page_size)
    else:  # self-attention, and one cross-attention sequence with fewer queries than keys
        k_lens = [1, 7, 16, 17, 40, 33]
        q_lens = [1, 7, 16, 17, 40, 9]
    case = testing.make_paged_case(
        q_lens,
        k_lens,
        page_size=page_size,
        num_q_heads=feature.num_q_heads,
        num_kv_heads=feature.num_kv_heads,
        head_dim=feature.head_dim,
        value_dim=feature.value_dim,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    lse_asked = kwargs.pop("return_lse", False)
    if feature.op == "paged_attention":
        run = lambda **kw: ops.paged_attention(**case.inputs(), backend=backend, **kw)
        reference = lambda **kw: testing.paged_attention_ref(**case.inputs(), **kw)
    else:  # varlen over the same sequences laid out contiguously
        k = torch.cat([testing.gather_sequence(case.k_cache, case.page_table[b], L) for b, L in enumerate(k_lens)])
        v = torch.cat([testing.gather_sequence(case.v_cache, case.page_table[b], L) for b, L in enumerate(k_lens)])
        args = (case.q, k, v, case.cu_seqlens_q, testing.cu_seqlens(k_lens, device))
        run = lambda **kw: ops.varlen_attention(*args, backend=backend, **kw)
        reference = lambda **kw: testing.varlen_attention_ref(*args, **kw)
    lowp = reference(upcast=False, **kwargs)
    if not lse_asked:
        ref = reference(**kwargs)
        out = run(**kwargs)
        return testing.max_error(out, ref), testing.tolerance(ref, lowp, dtype)
    (out, lse), (ref, ref_lse) = run(return_lse=True, **kwargs), reference(return_lse=True, **kwargs)
    results = [
        (testing.max_error(out, ref), testing.tolerance(ref, lowp, dtype)),
        (testing.lse_error(lse, ref_lse), testing.lse_tolerance(ref_lse, dtype)),
    ]
    return max(results, key=lambda r: r[0] / r[1])  # the output's or the LSE's, whichever is further off


def run_check(
    device: torch.device, backends: list[str], dtypes: list[str], page_sizes: tuple[int, ...]
) -> Iterator[dict]:
    """One row per (feature, backend, dtype) that the backend supports, as soon as it is measured."""
    for feature in FEATURES:
        for backend in backends:
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                sizes = page_sizes if feature.op == "paged_attention" else VARLEN_LAYOUTS
                worst_err, worst_tol, ok = 0.0, 0.0, True
                try:
                    results = [
                        _run_case(feature, backend, dtype, size, device, seed) for seed, size in enumerate(sizes)
                    ]
                except UnsupportedFeatureError:
                    continue  # the backend declares it does not do this; nothing to check
                for err, tol in results:
                    ok &= err <= tol
                    if not math.isfinite(err) or err / tol >= worst_err / max(worst_tol, 1e-30):
                        worst_err, worst_tol = err, tol
                yield dict(
                    op=feature.op,
                    feature=feature.name,
                    backend=backend,
                    dtype=dtype_name,
                    max_error=worst_err,
                    tolerance=worst_tol,
                    ok=ok,
                )


HEADER = f"{'op':<17} {'feature':<24} {'backend':<8} {'dtype':<5} {'max error':>10} {'tolerance':>10}  result"


def format_row(r: dict) -> str:
    return (
        f"{r['op']:<17} {r['feature']:<24} {r['backend']:<8} {r['dtype']:<5} "
        f"{r['max_error']:>10.2e} {r['tolerance']:>10.2e}  {'pass' if r['ok'] else 'FAIL'}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device to check (default: the accelerator, else cpu)")
    parser.add_argument(
        "--backend",
        action="append",
        default=None,
        help="backend to check (repeatable; default: every backend that runs on the device)",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=list(DTYPES),
        default=None,
        help="dtype to check (repeatable; default: all that the device computes correctly)",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        action="append",
        default=None,
        help=f"page size to check (repeatable; default: {' '.join(map(str, PAGE_SIZES))})",
    )


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device) if args.device else default_device()
    backends = args.backend or available_backends(device)
    dtypes = args.dtype or list(DTYPES)
    if args.dtype is None and is_triton_interpreter():
        # Triton's CPU interpreter computes bf16 dot products wrongly; check bf16 on a GPU.
        dtypes = [d for d in dtypes if d != "bf16"]
    page_sizes = tuple(args.page_size or PAGE_SIZES)
    print(f"portattn check on {device}: backends {backends}, dtypes {dtypes}, page sizes {list(page_sizes)}")
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    passed = failed = 0
    for row in run_check(device, backends, dtypes, page_sizes):
        print(format_row(row), flush=True)  # rows stream: Triton compiles a kernel per new shape
        passed += row["ok"]
        failed += not row["ok"]
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0
