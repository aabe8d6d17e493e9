"""Where the MLA decode step's time that does not grow with the keys goes (issue 24, item 1): on the GPU machine,
``PYTHONPATH=src python3 fixed_parts.py [--heads 17] [--batch 64] [--lengths 64,1024,4096,8192]``.

For the bf16 cache and an e4m3 one of the same rows (page 64, the plan's splits as ``bench.mla`` runs them), graph
replays rotating through page tables over a pool larger than the L2 (as ``bench.mla`` does, so the cache comes from
DRAM), each length timed twice:

* ``step``: the whole call, the attention kernel and the split merge;
* ``kernel``: the attention kernel alone (the launcher's merge launch left out).

Then, for each cache, the least-squares line of each through the lengths: its intercept is the part that does not
grow with the keys, its slope the ms a 4096 keys; ``step - kernel`` is the merge with the gap before it. On a machine
without a GPU, ``--small`` runs the bf16 cache's portable kernel under the interpreter on a tiny case (a check of the
script, no timing worth reading).
"""

from __future__ import annotations

import argparse
import functools
import statistics
from unittest import mock

import torch

from portattn.bench.timing import measure_graph
from portattn.kernels.triton import mla_decode_launch
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode

RANK, ROPE, PAGE = 512, 64, 64


class _NoLaunch:
    """Stands in for ``mla_decode_merge_kernel``: indexing by a grid gives a launcher that launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def call(table, *, q_nope, q_rope, cache, seq_lens, out, scale, plan, kv_scale) -> None:
    """One decode call over ``table``, as ``bench.mla`` makes it (the plan's splits, fewer where a kernel runs
    faster so)."""
    mla_decode_launch.mla_decode_forward(
        q_nope, q_rope, cache, table, seq_lens, out, scale=scale, num_kv_splits=plan.num_kv_splits,
        partials=plan.partials, kv_scale=kv_scale, fewer_splits=plan.splits_chosen,
    )  # fmt: skip


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``(xs, ys)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=17)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", default="64,1024,4096,8192", help="comma-separated keys a sequence")
    parser.add_argument("--sets", type=int, default=4, help="page tables to rotate through")
    parser.add_argument("--small", action="store_true", help="a tiny case on the CPU (checks the script)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    lengths = [64, 128] if args.small else [int(x) for x in args.lengths.split(",")]
    batch, heads = (2, 4) if args.small else (args.batch, args.heads)
    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_seq = -(-max(lengths) // PAGE)
    pool_pages = 2 * args.sets * batch * pages_per_seq  # the sets' tables drawn from twice their pages
    pool = torch.randn(pool_pages, PAGE, RANK + ROPE, dtype=torch.bfloat16, device=device, generator=gen)
    kv_scale = float(pool.abs().max()) / 240.0
    caches = {"bf16": (pool, 1.0)}
    if not args.small:
        caches["e4m3"] = (quantize_kv(pool, torch.float8_e4m3fn, kv_scale), kv_scale)
    q_nope = torch.randn(batch, heads, RANK, dtype=torch.bfloat16, device=device, generator=gen)
    q_rope = torch.randn(batch, heads, ROPE, dtype=torch.bfloat16, device=device, generator=gen)
    out = torch.empty_like(q_nope)
    scale = (128 + ROPE) ** -0.5
    times: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for length in lengths:
        pages = -(-length // PAGE)
        tables = [
            torch.randperm(pool_pages, device=device, generator=gen)[: batch * pages].view(batch, pages).int()
            for _ in range(args.sets)
        ]
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        plan = plan_mla_decode(tables[0], seq_lens, PAGE, num_heads=heads, kv_lora_rank=RANK, max_seqlen_k=length)
        for _ in range(2):
            for name, (cache, cache_scale) in caches.items():
                fn = functools.partial(
                    call, q_nope=q_nope, q_rope=q_rope, cache=cache, seq_lens=seq_lens, out=out, scale=scale,
                    plan=plan, kv_scale=cache_scale,
                )  # fmt: skip
                step = measure_graph(fn, tables, device).median_ms
                with mock.patch.object(mla_decode_launch, "mla_decode_merge_kernel", _NoLaunch()):
                    kernel = measure_graph(fn, tables, device).median_ms
                times.setdefault((name, "step"), []).append((length, step))
                times.setdefault((name, "kernel"), []).append((length, kernel))
                print(f"{name} B={batch} H={heads} L={length} splits {plan.num_kv_splits}: step {step:.4f} ms, "
                      f"kernel {kernel:.4f}, step - kernel {step - kernel:.4f}", flush=True)  # fmt: skip
    for (name, part), points in times.items():
        intercept, slope = line([x for x, _ in points], [y for _, y in points])
        print(f"{name} {part}: {intercept:.4f} ms that stays, {4096 * slope:.4f} ms a 4096 keys", flush=True)


if __name__ == "__main__":
    main()
