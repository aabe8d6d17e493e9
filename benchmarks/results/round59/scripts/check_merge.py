"""The seesaw kernel merging its splits itself (``MERGE_IN_KERNEL``) against the merge kernel, on the GPU: ragged
sequences (one of a single key, one of none, one just past a tile), pages 64 and 16, 17, 64 and 128 heads, 1, 2, 3
and 8 splits (8: past ``MERGE_MAX_SPLITS``, the merge kernel; call 1 merged them in the kernel too, and measured the
difference against half a rounding), eager and graph replays (three each: the counters must be back at 0 after every
launch). Prints the largest differences and fails where an output differs by more than a bfloat16 rounding of the
plain form's (the two sum the same partials in another order) or an LSE by more than 1e-5 of its magnitude:
``PYTHONPATH=src python3 check_merge.py``."""

import itertools

import torch

from portattn.kernels.triton import mla_decode_launch, mla_decode_seesaw_fp8, mla_decode_wide_fp8
from portattn.kernels.triton.mla_decode_launch import MLATileConfig
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode

SEESAW = MLATileConfig(64, 64, 8, 3, wide=True, producer=True, fp8_scores=True, fp8_values=True)


def run(qn, qr, kv, table, lens, splits, *, merge, graph=False):
    mla_decode_seesaw_fp8.MERGE_IN_KERNEL = merge
    try:
        meta = plan_mla_decode(table, lens, kv.shape[1], num_heads=qn.shape[1], kv_lora_rank=512,
                               max_seqlen_k=int(lens.max()), num_kv_splits=splits)  # fmt: skip
        out = torch.full_like(qn, float("nan"))
        lse = torch.full(qn.shape[:2], float("nan"), device=qn.device)

        def call():
            mla_decode_launch.mla_decode_forward(qn, qr, kv, table, lens, out, scale=0.07, lse=lse,
                                                 num_kv_splits=meta.num_kv_splits, partials=meta.partials,
                                                 kv_scale=0.05, tiles=SEESAW)  # fmt: skip

        for _ in range(3):
            out.fill_(float("nan"))
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
        mla_decode_seesaw_fp8.MERGE_IN_KERNEL = False


def main():
    mla_decode_wide_fp8.SEESAW = True
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    worst, worst_lse, failures, cases = 0.0, 0.0, [], 0
    for page, heads, batch, splits in itertools.product((64, 16), (17, 64, 128), (3, 40), (1, 2, 3, 8)):
        lens = torch.randint(1, 3000, (batch,), device=dev, generator=gen).to(torch.int32)
        lens[0] = 1
        lens[1] = 0
        lens[-1] = 64 * 5 + 1
        pages_a_seq = -(-3000 // page)
        pool = batch * pages_a_seq + 7
        cache = quantize_kv(torch.randn(pool, page, 576, device=dev, generator=gen), torch.float8_e4m3fn, 0.05)
        cache.view(torch.uint8)[-7:] = 0x7F  # unused pages: NaN
        table = torch.randperm(pool - 7, device=dev, generator=gen)[: batch * pages_a_seq]
        table = table.view(batch, pages_a_seq).to(torch.int32)
        qn = torch.randn(batch, heads, 512, device=dev, dtype=torch.bfloat16, generator=gen)
        qr = torch.randn(batch, heads, 64, device=dev, dtype=torch.bfloat16, generator=gen)
        base, base_lse = run(qn, qr, cache, table, lens, splits, merge=False)
        for graph in (False, True):
            cases += 1
            out, lse = run(qn, qr, cache, table, lens, splits, merge=True, graph=graph)
            err = (out - base).abs() / (base.abs() * 2.0**-7 + 1e-6)  # a bfloat16 rounding: at most 2^-7 of it
            lse_ok = (lse - base_lse).abs() <= 1e-5 * base_lse.abs() + 1e-6
            ok_lse = torch.where(base_lse.isinf(), lse == base_lse, lse_ok)
            worst = max(worst, err.max().item())
            finite = base_lse.isfinite()
            if finite.any():
                worst_lse = max(worst_lse, (lse - base_lse)[finite].abs().max().item())
            ok = bool((err <= 1).all()) and bool(ok_lse.all()) and not out.isnan().any()
            if not ok:
                failures.append((page, heads, batch, splits, graph, err.max().item(), int((~ok_lse).sum())))
    print(f"{cases} cases; largest output difference {worst:.3f} bfloat16 roundings, LSE {worst_lse:.2e};"
          f" {len(failures)} failures", flush=True)  # fmt: skip
    for f in failures[:20]:
        print("FAIL page {} heads {} batch {} splits {} graph {}: {:.3f} roundings, {} LSEs off".format(*f))


if __name__ == "__main__":
    main()
