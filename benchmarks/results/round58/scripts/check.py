"""The fp8 MLA kernels' options against their plain forms on the GPU, over ragged sequences, pages 64 and 16, 17 and
128 heads, 1 and 3 splits, in and out of a graph: ``PYTHONPATH=src python3 check.py``. Prints the largest difference
to the plain form's output (and LSE) and fails where one differs (call 1: where one exceeded a float32
reordering's). Call 1 (with ``l2_ahead_and_merge_in_kernel.patch``) checked the seesaw kernel asking the L2 for
tiles ahead (``L2_AHEAD``) and merging its splits itself (``MERGE_IN_KERNEL``); call 2 the ring's first tiles issued
before the queries load (``EARLY_TILES``) in the seesaw kernel and in the fp8-scores form with float16 values, with
the split merge launched as the kernel finishes (``launch.PDL``), against neither."""

import itertools

import torch

from portattn.kernels.triton import launch, mla_decode_launch, mla_decode_seesaw_fp8, mla_decode_wide_fp8
from portattn.kernels.triton.mla_decode_launch import MLATileConfig
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode

SEESAW = MLATileConfig(64, 64, 8, 3, wide=True, producer=True, fp8_scores=True, fp8_values=True)
FLOAT16_VALUES = MLATileConfig(64, 64, 8, 3, wide=True, producer=True, fp8_scores=True)


def run(qn, qr, kv, table, lens, splits, *, tiles, early, graph=False):
    mla_decode_seesaw_fp8.EARLY_TILES = mla_decode_wide_fp8.EARLY_TILES = launch.PDL = early
    try:
        meta = plan_mla_decode(table, lens, kv.shape[1], num_heads=qn.shape[1], kv_lora_rank=512,
                               max_seqlen_k=int(lens.max()), num_kv_splits=splits)  # fmt: skip
        out = torch.full_like(qn, float("nan"))
        lse = torch.full(qn.shape[:2], float("nan"), device=qn.device)

        def call():
            mla_decode_launch.mla_decode_forward(qn, qr, kv, table, lens, out, scale=0.07, lse=lse,
                                                 num_kv_splits=meta.num_kv_splits, partials=meta.partials,
                                                 kv_scale=0.05, tiles=tiles)  # fmt: skip

        call()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            for _ in range(3):
                out.fill_(float("nan"))
                g.replay()
        torch.cuda.synchronize()
        return out.float(), lse
    finally:
        mla_decode_seesaw_fp8.EARLY_TILES = mla_decode_wide_fp8.EARLY_TILES = launch.PDL = True


def main():
    assert mla_decode_wide_fp8.SEESAW
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    worst, failures = 0.0, []
    for page, heads, batch, splits in itertools.product((64, 16), (17, 128), (3, 40), (1, 3)):
        lens = torch.randint(1, 3000, (batch,), device=dev, generator=gen).to(torch.int32)
        lens[0] = 1
        lens[-1] = 64 * 5 + 1
        pages_a_seq = -(-3000 // page)
        pool = batch * pages_a_seq + 7
        cache = quantize_kv(torch.randn(pool, page, 576, device=dev, generator=gen), torch.float8_e4m3fn, 0.05)
        cache.view(torch.uint8)[-7:] = 0x7F  # unused pages: NaN
        table = torch.randperm(pool - 7, device=dev, generator=gen)[: batch * pages_a_seq]
        table = table.view(batch, pages_a_seq).to(torch.int32)
        qn = torch.randn(batch, heads, 512, device=dev, dtype=torch.bfloat16, generator=gen)
        qr = torch.randn(batch, heads, 64, device=dev, dtype=torch.bfloat16, generator=gen)
        for tiles, graph in ((SEESAW, False), (FLOAT16_VALUES, False), (SEESAW, True)):
            base, base_lse = run(qn, qr, cache, table, lens, splits, tiles=tiles, early=False)
            out, lse = run(qn, qr, cache, table, lens, splits, tiles=tiles, early=True, graph=graph)
            diff = (out - base).abs().max().item()
            lse_diff = (lse - base_lse).abs().max().item()
            scale = base.abs().max().item()
            worst = max(worst, diff / scale)
            ok = diff == 0 and lse_diff == 0 and not out.isnan().any()  # the same arithmetic in the same order
            if not ok:
                failures.append((page, heads, batch, splits, tiles.fp8_values, graph, diff, scale, lse_diff))
    print(f"largest difference {worst:.2e} of the output's largest; {len(failures)} failures", flush=True)
    for f in failures[:20]:
        print(
            "FAIL page {} heads {} batch {} splits {} fp8 values {} graph {}: {:.3e} of {:.3e}, lse {:.2e}".format(*f)
        )


if __name__ == "__main__":
    main()
