"""One MLA decode launch per variant (DeepSeek-V3 latent 512 + 64, 16 heads, B=64 over 4096 keys, page 64), to
run under Nsight Compute on the GPU machine: where the 16-head kernels' time goes (issue 24 item 1).

    ncu --clock-control none --kernel-name regex:mla_decode --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis python3 scripts/ncu_mla.py e4m3 --tiles 16,64,4,2 --splits 4

``bf16``: the bf16 cache with the default tiles; ``e4m3`` or ``e5m2``: that cache, with ``--tiles h,n,w,s``
through the ``fp8_mma`` kernel (default: the launcher's own choice). ``--splits`` overrides the plan's split
count. Each run makes four launches of the decode (three warm-ups, one profiled; the split merge is a kernel of
its own); ``--time`` times graph replays instead.
"""

from __future__ import annotations

import argparse

import torch

from portattn.bench.timing import measure_graph
from portattn.kernels.triton import mla_decode_launch
from portattn.kernels.triton.mla_decode_launch import MLATileConfig
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kv", choices=["bf16", "e4m3", "e5m2"])
    parser.add_argument("--tiles", default=None, help="block_h,block_n,warps,stages (e4m3: the fp8_mma kernel)")
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--maxnreg", type=int, default=None, help="fp8_mma: registers a thread at most")
    parser.add_argument(
        "--alu-scores",
        type=lambda x: int(x, 0),
        default=0,
        help="fp8_mma: mask of the score chunks unpacked by integer instructions (e.g. 0b01010)",
    )
    parser.add_argument(
        "--alu-values",
        type=lambda x: int(x, 0),
        default=0,
        help="fp8_mma: mask of the 16-key value steps unpacked by integer instructions",
    )
    parser.add_argument("--pages-ahead", action="store_true", help="fp8_mma: page ids loaded a step ahead")
    parser.add_argument(
        "--coalesced-io", action="store_true", help="fp8_mma: queries loaded and output stored 16 bytes a lane"
    )
    parser.add_argument(
        "--portable", action="store_true", help="the portable kernel's tiles (the launcher's rule without fp8_mma)"
    )
    parser.add_argument("--wide", action="store_true", help="the wide kernel's tiles (64-head blocks, 64 keys)")
    parser.add_argument(
        "--producer",
        action="store_true",
        help="the wide kernel's warp-specialized form (a producer warpgroup; over fp8 the default takes --fp8-scores)",
    )
    parser.add_argument(
        "--fp8-scores",
        action="store_true",
        help="its fp8-scores form (mla_decode_wide_fp8; an fp8 cache; the default there above 32 heads)",
    )
    parser.add_argument("--fp8-values", action="store_true", help="with --fp8-scores: the value product in fp8")
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="with --fp8-scores: the consumers pipelined (mla_decode_wide_fp8.PIPELINED)",
    )
    parser.add_argument(
        "--seesaw",
        action="store_true",
        help="with --fp8-scores --fp8-values: the seesaw kernel (mla_decode_wide_fp8.SEESAW; mla_decode_seesaw_fp8)",
    )
    parser.add_argument(
        "--vregs",
        action="store_true",
        help="with --seesaw: its value products read from registers (mla_decode_wide_fp8.SEESAW_VREGS)",
    )
    parser.add_argument("--ring", type=int, default=2, help="with --fp8-scores: fp8 tiles in flight (2: its default)")
    parser.add_argument("--block-n", type=int, default=64, help="with --wide or --fp8-scores: keys a tile (32 or 64)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="sequences (each over --keys keys)")
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--page", type=int, default=64, help="keys a page")
    parser.add_argument("--time", action="store_true", help="time graph replays instead (median ms)")
    parser.add_argument(
        "--resident", action="store_true", help="every sequence reads the same pages (the L2 holds them all)"
    )
    args = parser.parse_args()
    if (args.pipelined or args.seesaw) and not args.fp8_scores:
        parser.error("--pipelined and --seesaw are forms of --fp8-scores")
    if args.seesaw and not args.fp8_values:
        parser.error("--seesaw takes fp8 values (--fp8-values)")
    if args.vregs and not args.seesaw:
        parser.error("--vregs is a form of --seesaw")
    if args.pipelined or args.seesaw:
        from portattn.kernels.triton import mla_decode_wide_fp8

        mla_decode_wide_fp8.PIPELINED = args.pipelined
        mla_decode_wide_fp8.SEESAW = args.seesaw
        if args.vregs:  # else as set (round 60's many.py sets it by its cases' prefixes)
            mla_decode_wide_fp8.SEESAW_VREGS = True
    dev = torch.device("cuda")
    b, L, P, heads = args.batch, args.keys, args.page, args.heads
    gen = torch.Generator(device=dev).manual_seed(0)
    pages = b * L // P + 4
    cache = torch.randn(pages, P, 576, device=dev, dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(pages, device=dev, generator=gen)[: b * L // P].view(b, L // P).to(torch.int32)
    if args.resident:
        table = table[:1].expand(b, -1).contiguous()
    lens = torch.full((b,), L, device=dev, dtype=torch.int32)
    qn = torch.randn(b, heads, 512, device=dev, dtype=torch.bfloat16, generator=gen)
    qr = torch.randn(b, heads, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(qn)
    fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    kv, kv_scale = (cache, 1.0) if args.kv == "bf16" else (quantize_kv(cache, fp8[args.kv], 0.05), 0.05)
    tiles = None
    if args.tiles:
        h, n, w, s = (int(x) for x in args.tiles.split(","))
        tiles = MLATileConfig(h, n, w, s, fp8_mma=args.kv != "bf16", maxnreg=args.maxnreg,
                              alu_scores=args.alu_scores, alu_values=args.alu_values,
                              pages_ahead=args.pages_ahead, coalesced_io=args.coalesced_io)  # fmt: skip
    elif args.wide or args.producer or args.fp8_scores:
        forms = {"producer": args.producer or args.fp8_scores, "fp8_scores": args.fp8_scores}
        tiles = MLATileConfig(64, args.block_n, 8, args.ring, wide=True, fp8_values=args.fp8_values, **forms)
    elif args.portable:
        tiles = mla_decode_launch.choose_tiles(
            heads, qn.dtype, interpret=False, kv_dtype=kv.dtype, fp8_mma=False, wide=False
        )
    meta = plan_mla_decode(table, lens, P, num_heads=heads, kv_lora_rank=512, max_seqlen_k=L,
                           num_kv_splits=args.splits)  # fmt: skip
    splits, partials = meta.num_kv_splits, meta.partials

    def call(_=None):
        mla_decode_launch.mla_decode_forward(qn, qr, kv, table, lens, out, scale=0.07, num_kv_splits=splits,
                                             partials=partials, tiles=tiles, kv_scale=kv_scale,
                                             fewer_splits=meta.splits_chosen)  # fmt: skip

    for _ in range(4):
        call()
    torch.cuda.synchronize()
    label = f"{args.kv} B={b} L={L} heads {heads} splits {splits} tiles {args.tiles or 'default'}"
    label += f" page {P}" if P != 64 else ""
    if args.portable:
        label += " portable"
    if args.wide or args.producer or args.fp8_scores:
        label += " wide" + (" fp8 scores" if args.fp8_scores else " producer" if args.producer else "")
        label += (" fp8 values" if args.fp8_values else "") + (f" ring {args.ring}" if args.ring > 2 else "")
        label += f" {args.block_n} keys" if args.block_n != 64 else ""
        label += " pipelined" if args.pipelined else " seesaw" if args.seesaw else ""
    if meta.splits_chosen:
        label += " (the plan's splits: fp8_mma may run fewer)"
    if args.maxnreg:
        label += f" maxnreg {args.maxnreg}"
    if args.alu_scores or args.alu_values:
        label += f" alu {args.alu_scores:#07b} {args.alu_values:#06b}"
    if args.pages_ahead:
        label += " pages ahead"
    if args.resident:
        label += " resident"
    if args.coalesced_io:
        label += " coalesced io"
    if args.time:
        t = measure_graph(call, [0, 1], dev)
        nbytes = b * L * 576 * (2 if args.kv == "bf16" else 1)
        print(f"{label}: {t.median_ms:.4f} ms (spread {t.spread:.1%}), {nbytes / t.median_ms / 1e9:.2f} TB/s")
    else:
        print(label)


if __name__ == "__main__":
    main()
