"""Where each program of the seesaw kernel spends the MLA decode step's time that does not grow with the keys
(``stamps.patch`` applied, or for round 68's second call ``stamps2.patch``): ``PYTHONPATH=src python3 stamps.py
[--heads 17] [--lengths 64,1024,4096,8192] [--neither] [--early N]``.

For an e4m3 cache (64 sequences, page 64, the plan's splits as ``bench.mla`` runs them, a page table per launch
drawn from a pool larger than the L2), the kernel's ``%globaltimer`` stamps of every program (ns):

* 0 the program's entry, 1 its queries stored (the prologue's end), 7 the producer's start;
* 2 the first tile's copy arrived, 3 the last tile's;
* 4 the left warpgroup's last product done, 5 and 6 the left's and the right's results stored.

Printed per length: the spread of the entries, then the median and largest of each stretch, and the kernel's span
(the first entry to the last store)."""

from __future__ import annotations

import argparse
import statistics

import torch

from portattn.kernels.triton import mla_decode_launch
from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode

RANK, ROPE, PAGE = 512, 64, 64
STRETCHES = (
    ("prologue (queries)", 0, 1),
    ("producer's start", 1, 7),
    ("first copy", 7, 2),
    ("the rest of the copies", 2, 3),
    ("last tile to last product", 3, 4),
    ("left's stores", 4, 5),
    ("whole program", 0, 5),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=17)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", default="64,1024,4096,8192")
    parser.add_argument("--neither", action="store_true", help="launch.PDL and EARLY_COPIES off")
    parser.add_argument("--early", type=int, help="EARLY_COPIES")
    args = parser.parse_args()
    if args.neither:
        from portattn.kernels.triton import launch as attention_launch

        attention_launch.PDL, seesaw.EARLY_COPIES = False, 0
    if args.early is not None:
        seesaw.EARLY_COPIES = args.early
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    batch, heads = args.batch, args.heads
    launches = 6
    pool_pages = 2 * launches * batch * -(-max(lengths) // PAGE)
    pool = torch.randn(pool_pages, PAGE, RANK + ROPE, dtype=torch.bfloat16, device=device, generator=gen)
    kv_scale = float(pool.abs().max()) / 240.0
    cache = quantize_kv(pool, torch.float8_e4m3fn, kv_scale)
    del pool
    q_nope = torch.randn(batch, heads, RANK, dtype=torch.bfloat16, device=device, generator=gen)
    q_rope = torch.randn(batch, heads, ROPE, dtype=torch.bfloat16, device=device, generator=gen)
    out = torch.empty_like(q_nope)
    scale = (128 + ROPE) ** -0.5
    for length in lengths:
        pages = -(-length // PAGE)
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        tables = [
            torch.randperm(pool_pages, device=device, generator=gen)[: batch * pages].view(batch, pages).int()
            for _ in range(launches)
        ]
        plan = plan_mla_decode(tables[0], seq_lens, PAGE, num_heads=heads, kv_lora_rank=RANK, max_seqlen_k=length)
        grid_programs = -(-heads // 64) * batch * plan.num_kv_splits  # the plan's count; fewer may run
        stamps = torch.zeros(grid_programs, 8, dtype=torch.int64, device=device)
        seesaw.STAMPS = stamps
        for table in tables:
            stamps.zero_()
            mla_decode_launch.mla_decode_forward(
                q_nope, q_rope, cache, table, seq_lens, out, scale=scale, num_kv_splits=plan.num_kv_splits,
                partials=plan.partials, kv_scale=kv_scale, fewer_splits=plan.splits_chosen,
            )  # fmt: skip
        torch.cuda.synchronize()
        seesaw.STAMPS = None
        s = stamps.cpu()
        ran = s[:, 0] > 0
        s = s[ran].double() / 1000.0  # us
        t0 = float(s[:, 0].min())
        entries = s[:, 0] - t0
        print(f"L={length} programs {int(ran.sum())} of {grid_programs} (plan: {plan.num_kv_splits} splits): entries "
              f"over {float(entries.max()):.2f} us (median {float(entries.median()):.2f})", flush=True)  # fmt: skip
        for name, a, b in STRETCHES:
            d = (s[:, b] - s[:, a]).tolist()
            print(f"  {name:28s} median {statistics.median(d):7.2f} us, max {max(d):7.2f}, min {min(d):7.2f}")
        ends = torch.maximum(s[:, 5], s[:, 6])
        print(
            f"  kernel span {float(ends.max()) - t0:.2f} us; last entry to first end "
            f"{float(ends.min() - s[:, 0].max()):.2f}; ends over {float(ends.max() - ends.min()):.2f} us"
        )
        steps = sorted({round(x, 3) for x in (s[:, 2] - s[:, 7]).tolist()})[:6]
        print(f"  timer steps seen (us): {steps}", flush=True)


if __name__ == "__main__":
    main()
