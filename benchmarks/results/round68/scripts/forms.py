"""The MLA decode step with and without the changes of round 68 that landed, timed alternately in one process:
programmatic dependent launch of the split merge (``launch.PDL``), the seesaw kernel's ``EARLY_COPIES`` and (not
yet timed, off by default) its ``KEEP_QUERIES``, as
``bench.mla`` times a case (graph replays rotating through page tables over a pool larger than the L2, page 64, the
plan's splits): ``PYTHONPATH=src python3 forms.py [--cases 17:4096,64:4096,128:4096,17:8192] [--rounds 3]``.

Each round times every form of each case once, the bf16 cache (its kernel takes no ``EARLY_COPIES``; its merge takes
PDL) beside the e4m3 one; printed: each form's median over the rounds and its spread, and e4m3's ratio to the bf16
cache with PDL and without (round 67's step). The runs of round 68 (``gpu_run/``) timed forms since removed: the
seesaw kernel launched with PDL itself, its first copies before the queries' loads, and a merge loading 8 splits at
once (``NOTES.md``)."""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from portattn.bench.timing import measure_graph
from portattn.kernels.triton import launch as attention_launch
from portattn.kernels.triton import mla_decode_launch
from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode

RANK, ROPE, PAGE, SETS = 512, 64, 64, 4
FORMS = {  # name: (launch.PDL, EARLY_COPIES, KEEP_QUERIES)
    "round 67": (False, False, False),
    "early": (False, True, False),
    "pdl": (True, False, False),
    "all": (True, True, False),
    "kept queries": (True, True, True),
}


def call(table, *, q_nope, q_rope, cache, seq_lens, out, scale, plan, kv_scale) -> None:
    mla_decode_launch.mla_decode_forward(
        q_nope, q_rope, cache, table, seq_lens, out, scale=scale, num_kv_splits=plan.num_kv_splits,
        partials=plan.partials, kv_scale=kv_scale, min_split_keys=plan.min_split_keys, fewer_splits=plan.splits_chosen,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="17:4096,64:4096,128:4096,17:8192", help="heads:keys, comma-separated")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    batch = args.batch
    pool_pages = 2 * SETS * batch * -(-max(k for _, k in cases) // PAGE)
    pool = torch.randn(pool_pages, PAGE, RANK + ROPE, dtype=torch.bfloat16, device=device, generator=gen)
    kv_scale = float(pool.abs().max()) / 240.0
    fp8 = quantize_kv(pool, torch.float8_e4m3fn, kv_scale)
    scale = (128 + ROPE) ** -0.5
    saved = attention_launch.PDL, seesaw.EARLY_COPIES, seesaw.KEEP_QUERIES
    for heads, length in cases:
        q_nope = torch.randn(batch, heads, RANK, dtype=torch.bfloat16, device=device, generator=gen)
        q_rope = torch.randn(batch, heads, ROPE, dtype=torch.bfloat16, device=device, generator=gen)
        out = torch.empty_like(q_nope)
        pages = -(-length // PAGE)
        tables = [
            torch.randperm(pool_pages, device=device, generator=gen)[: batch * pages].view(batch, pages).int()
            for _ in range(SETS)
        ]
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        plan = plan_mla_decode(tables[0], seq_lens, PAGE, num_heads=heads, kv_lora_rank=RANK, max_seqlen_k=length)
        runs = [("e4m3 " + f, fp8, kv_scale, *FORMS[f]) for f in FORMS]
        runs += [("bf16 all", pool, 1.0, *FORMS["all"]), ("bf16 round 67", pool, 1.0, *FORMS["round 67"])]
        times: dict[str, list[float]] = {}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name, cache, cache_scale, pdl, early, keep in runs:
                attention_launch.PDL, seesaw.EARLY_COPIES, seesaw.KEEP_QUERIES = pdl, early, keep
                fn = functools.partial(call, q_nope=q_nope, q_rope=q_rope, cache=cache, seq_lens=seq_lens, out=out,
                                       scale=scale, plan=plan, kv_scale=cache_scale)  # fmt: skip
                times.setdefault(name, []).append(measure_graph(fn, tables, device).median_ms)
                fn(tables[0])
                outs[name] = out.clone()
        attention_launch.PDL, seesaw.EARLY_COPIES, seesaw.KEEP_QUERIES = saved
        print(f"H={heads} L={length} B={batch} splits {plan.num_kv_splits}", flush=True)
        bf16 = {k: statistics.median(times["bf16 " + k]) for k in ("all", "round 67")}
        for name, ts in times.items():
            med = statistics.median(ts)
            ref = "e4m3 round 67" if name.startswith("e4m3") else "bf16 round 67"
            same = torch.equal(outs[name], outs[ref])
            ratios = (
                ""
                if name.startswith("bf16")
                else f", x{bf16['all'] / med:.3f} bf16 (x{bf16['round 67'] / med:.3f} round 67's)"
            )
            print(f"  {name:14s} {med:.4f} ms (spread {min(ts):.4f}-{max(ts):.4f}){ratios}; "
                  f"output as {ref}'s: {same}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
