"""The MLA decode step in the forms round 69 tried, timed alternately in one process: round 68's landed step
(programmatic dependent launch of the split merge, ``EARLY_COPIES``), with 16-32 head rows' queries in one pass
(``ONE_PASS``), with the queries kept in shared memory for the second pass (``KEEP_QUERIES``), and with both (round 69's
defaults), as ``bench.mla`` times a case (graph replays rotating through page tables over a pool larger than the L2,
page 64, the plan's splits): ``PYTHONPATH=src python3 forms.py [--cases 17:4096,64:4096] [--rounds 3]``.

Each round times every form of each case once, the bf16 cache (with and without the merge's PDL) beside the e4m3 one;
printed: each form's median over the rounds and its spread, e4m3's ratio to the bf16 cache with PDL and without, and
whether its output equals round 68's bit for bit. Round 69's first call ran it at d4b0678 with two forms more: the
first copies' page ids loaded together (``PAGES_AT_ONCE``, since removed), alone and with ``ONE_PASS``, and that pair
without ``EARLY_COPIES`` (``NOTES.md``)."""

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
FORMS = {  # name: (launch.PDL, EARLY_COPIES, KEEP_QUERIES, ONE_PASS)
    "round 68": (True, True, False, False),
    "one pass": (True, True, False, True),
    "kept queries": (True, True, True, False),
    "both": (True, True, True, True),
}
SWITCHES = ("EARLY_COPIES", "KEEP_QUERIES", "ONE_PASS")


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
    saved = attention_launch.PDL, *(getattr(seesaw, k) for k in SWITCHES)
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
        runs += [("bf16 pdl", pool, 1.0, *FORMS["round 68"]), ("bf16 no pdl", pool, 1.0, False, *FORMS["round 68"][1:])]
        times: dict[str, list[float]] = {}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name, cache, cache_scale, pdl, *switches in runs:
                attention_launch.PDL = pdl
                for key, value in zip(SWITCHES, switches):
                    setattr(seesaw, key, value)
                fn = functools.partial(call, q_nope=q_nope, q_rope=q_rope, cache=cache, seq_lens=seq_lens, out=out,
                                       scale=scale, plan=plan, kv_scale=cache_scale)  # fmt: skip
                times.setdefault(name, []).append(measure_graph(fn, tables, device).median_ms)
                fn(tables[0])
                outs[name] = out.clone()
        attention_launch.PDL = saved[0]
        for key, value in zip(SWITCHES, saved[1:]):
            setattr(seesaw, key, value)
        print(f"H={heads} L={length} B={batch} splits {plan.num_kv_splits}", flush=True)
        bf16 = {k: statistics.median(times["bf16 " + k]) for k in ("pdl", "no pdl")}
        for name, ts in times.items():
            med = statistics.median(ts)
            ref = "e4m3 round 68" if name.startswith("e4m3") else "bf16 no pdl"
            same = torch.equal(outs[name], outs[ref])
            ratios = (
                ""
                if name.startswith("bf16")
                else f", x{bf16['pdl'] / med:.3f} bf16 (x{bf16['no pdl'] / med:.3f} no PDL)"
            )
            print(f"  {name:14s} {med:.4f} ms (spread {min(ts):.4f}-{max(ts):.4f}){ratios}; "
                  f"output as {ref}'s: {same}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
