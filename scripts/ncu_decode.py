"""One paged decode launch per KV-cache dtype (B=64 L=4096 P=16, Hq 32 / Hkv 8 / D 128), to run under
Nsight Compute on the GPU machine:

    ncu --clock-control none --kernel-name regex:attention_fwd --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 scripts/ncu_decode.py bf16

Each dtype runs four launches (three warm-ups, one profiled); ``--splits`` and ``--tiles n,w,s`` override the
launcher's choice.
"""

import argparse

import torch

from portattn.bench.paged_attention import PagedCase, _inputs
from portattn.bench.timing import measure_graph
from portattn.kernels.triton.launch import TileConfig, attention_forward, choose_num_kv_splits, choose_tiles
from portattn.kv_quant import quantize_kv

DTYPES = {"bf16": None, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kv", choices=sorted(DTYPES))
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--tiles", default=None, help="block_n,warps,stages")
    parser.add_argument("--time", action="store_true", help="time graph replays instead (median ms)")
    parser.add_argument("--save", default=None, help="write the output tensor to this file")
    args = parser.parse_args()
    dev = torch.device("cuda")
    case = PagedCase("decode B=64 L=4096 P=16", 64, 1, 4096, peers=())
    s = _inputs(case, torch.bfloat16, dev, 0)
    scale = 1.0
    if DTYPES[args.kv] is not None:
        scale = 0.5
        s = {**s, **{n: quantize_kv(s[n], DTYPES[args.kv], scale) for n in ("k_cache", "v_cache")}}
    tiles = None
    if args.tiles:
        n, w, st = (int(x) for x in args.tiles.split(","))
        d = choose_tiles(1, 4, 128, 128, interpret=False)
        tiles = TileConfig(d.block_q, d.block_m, n, w, st)
    splits = args.splits or choose_num_kv_splits(case.k_len, case.batch, case.num_q_heads, 1)
    out = torch.empty(64, 32, 128, device=dev, dtype=torch.bfloat16)
    cu_q = torch.arange(0, 65, device=dev, dtype=torch.int32)
    lens = torch.full((64,), case.k_len, device=dev, dtype=torch.int32)

    def call(_=None):
        attention_forward(
            s["q"], s["k_cache"], s["v_cache"], out, cu_q, lens, max_seqlen_q=1, scale=128**-0.5,
            page_table=s["page_table"], num_kv_splits=splits, tiles=tiles, k_scale=scale, v_scale=scale,
        )  # fmt: skip

    for _ in range(4):
        call()
    torch.cuda.synchronize()
    if args.save:
        torch.save(out.cpu(), args.save)
    if args.time:
        t = measure_graph(call, [0, 1], dev)
        label = f"{args.kv} splits {splits} tiles {args.tiles or 'default'}"
        print(f"{label}: {t.median_ms:.4f} ms (spread {t.spread:.1%})")


if __name__ == "__main__":
    main()
