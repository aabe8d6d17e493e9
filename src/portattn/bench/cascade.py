"""Benchmark of cascade attention against plain paged attention (``python -m portattn.bench.cascade``, GPU).

``B`` requests share a prefix of ``S`` keys (the same physical pages) and each has ``own`` keys of
its own, the new tokens among them. Timed in the same run, planned once and called per layer:

* ``plain``: ``paged_attention`` over the full sequences (each request walks the shared pages);
* ``cascade``: the shared pass (all queries as one sequence over the shared pages), the own pass
  and the merge (``portattn.cascade.run_cascade``), with its three steps also timed apart;
* ``plain_distinct``: plain paged attention where every request has prefix pages of its own (no
  page is shared, so none is served again from the L2 cache): what the keys cost unshared;
* with ``--sweep``, the whole cascade with the shared pass at other split counts (Triton, decodes).

``kv_bytes`` counts the K/V bytes each way must read at least: plain ``B * (S + own)`` rows,
cascade ``S + B * own`` rows. Results (median ms, ratios, the largest difference between the
cascade and plain outputs) go to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..backends.base import AttentionParams, Request
from ..backends.registry import select_backend
from ..cascade import CascadeMetadata, plan_cascade, run_cascade
from ..device import default_device, is_gpu
from .timing import measure, num_input_sets


@dataclass(frozen=True)
class CascadeCase:
    name: str
    batch: int
    shared: int  # keys every request shares (a multiple of page_size)
    own: int  # keys of each request past the shared ones, its new tokens included
    q_len: int = 1  # new tokens per request
    page_size: int = 16
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


CASES = [
    CascadeCase("decode B=64 shared=8192 own=256", 64, 8192, 256),
    CascadeCase("decode B=16 shared=32768 own=512", 16, 32768, 512),
    CascadeCase("decode B=256 shared=2048 own=128", 256, 2048, 128),
    CascadeCase("extend B=64 shared=8192 own=256 (all new)", 64, 8192, 256, q_len=256),
]


def _inputs(case: CascadeCase, dtype: torch.dtype, device: torch.device, seed: int, *, distinct: bool) -> dict:
    """Pages placed at random in one pool; ``distinct``: every request gets prefix pages of its own."""
    gen = torch.Generator(device=device).manual_seed(seed)
    p = case.page_size
    shared_pages, own_pages = case.shared // p, -(-case.own // p)
    copies = case.batch if distinct else 1
    num_pages = copies * shared_pages + case.batch * own_pages + 4
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    prefix = perm[: copies * shared_pages].view(copies, shared_pages).expand(case.batch, shared_pages)
    own = perm[copies * shared_pages : copies * shared_pages + case.batch * own_pages].view(case.batch, own_pages)
    shape = (num_pages, p, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(case.batch * case.q_len, case.num_q_heads, case.head_dim, generator=gen, device=device)
    return {
        "q": q.to(dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "page_table": torch.cat([prefix, own], dim=1).contiguous(),  # [B, shared_pages + own_pages]
    }


def run_case(
    case: CascadeCase,
    device: torch.device,
    *,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "triton",
    sweep: bool = False,
    runs: int = 50,
) -> dict:
    elt = torch.tensor([], dtype=dtype).element_size()
    row_bytes = case.num_kv_heads * 2 * case.head_dim * elt  # one token's K and V
    request = Request(
        "paged_attention",
        device.type,
        dtype,
        case.head_dim,
        frozenset({"lse", "non_causal"}),
        frozenset({"merge_attention_states"}),
    )
    impl = select_backend("attention", backend, request)
    b = case.batch
    result = {
        "case": case.name,
        **{key: value for key, value in asdict(case).items() if key != "name"},
        "backend": impl.name,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_bytes": {
            "plain": b * (case.shared + case.own) * row_bytes,
            "cascade": (case.shared + b * case.own) * row_bytes,
        },
        "ms": {},
    }
    bench = _Bench(case, impl, device, dtype, runs)
    # The sweep is for decode batches: a long query run's shared pass is not split anyway.
    result.update(bench.shared_layout(sweep=sweep and impl.name == "triton" and case.q_len <= 8))
    result["ms"]["plain_distinct"] = bench.distinct_layout()
    ms = result["ms"]
    result["speedup_vs_plain"] = ms["plain"] / ms["cascade"]
    result["speedup_vs_plain_distinct"] = ms["plain_distinct"] / ms["cascade"]
    return result


class _Bench:
    """One case's inputs, plans and timings (each layout's pool is freed when its method returns)."""

    def __init__(self, case: CascadeCase, impl, device: torch.device, dtype: torch.dtype, runs: int):
        self.case, self.impl, self.device, self.dtype, self.runs = case, impl, device, dtype, runs
        b, n = case.batch, case.q_len
        self.cu_q = torch.arange(0, b + 1, device=device, dtype=torch.int32) * n
        self.seq_lens_k = torch.full((b,), case.shared + case.own, device=device, dtype=torch.int32)
        self.params = AttentionParams(scale=case.head_dim**-0.5)
        self.out = torch.empty(b * n, case.num_q_heads, case.head_dim, device=device, dtype=dtype)
        self.row_bytes = case.num_kv_heads * 2 * case.head_dim * torch.tensor([], dtype=dtype).element_size()

    def _sets(self, distinct: bool) -> list[dict]:
        c = self.case
        unique_rows = c.batch * (c.shared + c.own) if distinct else c.shared + c.batch * c.own
        count = num_input_sets(unique_rows * self.row_bytes)
        return [_inputs(c, self.dtype, self.device, seed, distinct=distinct) for seed in range(count)]

    def _time(self, fn, sets) -> float:
        return measure(fn, list(range(len(sets))), self.device, runs=self.runs).median_ms

    def _plain(self, s: dict, metadata, out: torch.Tensor) -> torch.Tensor:
        return self.impl.paged_attention(s["q"], s["k_cache"], s["v_cache"], metadata, self.params, out)

    def _cascade(self, s: dict, metadata: CascadeMetadata, out: torch.Tensor) -> torch.Tensor:
        return run_cascade(self.impl, metadata, s["q"], s["k_cache"], s["v_cache"], self.params, out)

    def shared_layout(self, *, sweep: bool) -> dict:
        c, impl = self.case, self.impl
        sets = self._sets(distinct=False)
        table = sets[0]["page_table"]
        plain_md = impl.plan_paged(self.cu_q, self.seq_lens_k, table, c.page_size, num_heads=c.num_q_heads)
        md = plan_cascade(impl, table, self.cu_q, self.seq_lens_k, c.page_size, c.shared, num_heads=c.num_q_heads)
        ms = {
            "plain": self._time(lambda i: self._plain(sets[i], plain_md, self.out), sets),
            "cascade": self._time(lambda i: self._cascade(sets[i], md, self.out), sets),
            **self._steps(md, sets),
        }
        plain_out = self._plain(sets[0], plain_md, torch.empty_like(self.out))
        cascade_out = self._cascade(sets[0], md, torch.empty_like(self.out))
        found = {
            "ms": ms,
            "num_kv_splits": {
                "plain": getattr(plain_md, "num_kv_splits", None),
                "shared_pass": getattr(md.shared, "num_kv_splits", None),
                "own_pass": getattr(md.own, "num_kv_splits", None),
            },
            "max_abs_diff_vs_plain": float((plain_out.float() - cascade_out.float()).abs().max()),
        }
        if sweep:
            found["shared_pass_splits"] = self._sweep_shared_splits(md, sets)
        return found

    def distinct_layout(self) -> float:
        sets = self._sets(distinct=True)
        c = self.case
        md = self.impl.plan_paged(
            self.cu_q, self.seq_lens_k, sets[0]["page_table"], c.page_size, num_heads=c.num_q_heads
        )
        return self._time(lambda i: self._plain(sets[i], md, self.out), sets)

    def _steps(self, md: CascadeMetadata, sets: list[dict]) -> dict:
        """The cascade's three steps timed apart (into buffers like those run_cascade allocates)."""
        q = sets[0]["q"]
        shape = (q.shape[0], q.shape[1], self.out.shape[-1])
        o1, o2 = (torch.empty(shape, dtype=torch.float32, device=q.device) for _ in range(2))
        l1, l2, l3 = (torch.empty(shape[:2], dtype=torch.float32, device=q.device) for _ in range(3))
        shared_params = AttentionParams(scale=self.params.scale, causal=False)
        run = lambda meta, p, o, l: (
            lambda i: self.impl.paged_attention(sets[i]["q"], sets[i]["k_cache"], sets[i]["v_cache"], meta, p, o, lse=l)
        )
        return {
            "shared_pass": self._time(run(md.shared, shared_params, o1, l1), sets),
            "own_pass": self._time(run(md.own, self.params, o2, l2), sets),
            "merge": self._time(lambda i: self.impl.merge_attention_states([o1, o2], [l1, l2], self.out, l3), sets),
        }

    def _sweep_shared_splits(self, md: CascadeMetadata, sets: list[dict]) -> dict:
        """Median ms of the whole cascade with the shared pass forced to other split counts (Triton)."""
        c, found = self.case, {}
        for splits in (1, 2, 4, 8, 16, 32, 64):
            shared = self.impl.plan_paged(
                torch.tensor([0, c.batch * c.q_len], dtype=torch.int32, device=self.device),
                torch.tensor([c.shared], dtype=torch.int32, device=self.device),
                sets[0]["page_table"][:1, : c.shared // c.page_size],
                c.page_size,
                num_kv_splits=splits,
            )
            forced = CascadeMetadata(shared, md.own, md.shared_prefix_len)
            found[splits] = self._time(lambda i, m=forced: self._cascade(sets[i], m, self.out), sets)
        return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portattn.bench.cascade", description=__doc__)
    parser.add_argument("--case", action="append", default=None, help="run cases whose name contains this")
    parser.add_argument("--backend", default="triton", help="attention backend (default: triton)")
    parser.add_argument("--sweep", action="store_true", help="also time the shared pass at other split counts")
    parser.add_argument("--out", default="benchmarks/results/cascade.json", help="JSON file to write")
    parser.add_argument("--label", default="", help="a free-form device description stored in the JSON")
    args = parser.parse_args(argv)
    device = default_device()
    if not is_gpu(device):
        print(f"the benchmark needs a GPU (found {device})")
        return 1
    cases = [c for c in CASES if not args.case or any(s in c.name for s in args.case)]
    results = []
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        t0 = time.time()
        r = run_case(case, device, backend=args.backend, sweep=args.sweep)
        results.append(r)
        path.write_text(json.dumps({"device": str(device), "label": args.label, "cases": results}, indent=1))
        ms = r["ms"]
        print(
            f"{case.name:<44} plain {ms['plain']:.3f} ms  cascade {ms['cascade']:.3f} ms "
            f"(shared {ms['shared_pass']:.3f} + own {ms['own_pass']:.3f} + merge {ms['merge']:.3f})  "
            f"{r['speedup_vs_plain']:.2f}x  (unshared plain {ms['plain_distinct']:.3f} ms, "
            f"{r['speedup_vs_plain_distinct']:.2f}x)  diff {r['max_abs_diff_vs_plain']:.1e}  "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )
        if "shared_pass_splits" in r:
            print("   shared-pass splits:", {k: round(v, 3) for k, v in r["shared_pass_splits"].items()}, flush=True)
        if hasattr(torch.accelerator, "empty_cache"):
            torch.accelerator.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
