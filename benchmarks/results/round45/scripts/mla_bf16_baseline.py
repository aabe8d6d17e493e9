"""The bf16 cache's MLA decode at 32 heads under every tile form that takes it, beside the fp8 caches' default:
whether the 32-head ratio (fp8_mma in 16-head blocks, 1.91x the bf16 cache's default in round 44) holds against
the fastest bf16 form, not only the default one. B=64 and 128 over 4096 keys, page 64, graph replays (median).
Each form's output is compared with the default form's.

    PYTHONPATH=src python benchmarks/results/round45/scripts/mla_bf16_baseline.py [HEADS,... [BATCHES,... [FORMS,...]]]
"""

from __future__ import annotations

import functools
import sys

import torch

from portattn.bench.timing import measure_graph
from portattn.kernels.triton import mla_decode_launch
from portattn.kernels.triton.mla_decode_launch import WIDE_TILES, MLATileConfig
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode

FORMS = {
    "default": None,
    "wide 64-head block": WIDE_TILES,
    "portable 16,32,4,3": MLATileConfig(16, 32, 4, 3),
    "portable 32,64,8,2": MLATileConfig(32, 64, 8, 2),
    "portable 64,32,8,3": MLATileConfig(64, 32, 8, 3),
}


def decode(qn, qr, kv, table, lens, out, meta, tiles, kv_scale, _=None) -> None:
    mla_decode_launch.mla_decode_forward(
        qn, qr, kv, table, lens, out, scale=0.07, num_kv_splits=meta.num_kv_splits, partials=meta.partials,
        tiles=tiles, kv_scale=kv_scale, fewer_splits=meta.splits_chosen,
    )  # fmt: skip


def main() -> None:
    dev = torch.device("cuda")
    P, L = 64, 4096
    heads_list = [int(h) for h in sys.argv[1].split(",")] if len(sys.argv) > 1 else [32, 48]
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 128]
    forms = {k: FORMS[k] for k in sys.argv[3].split(",")} if len(sys.argv) > 3 else FORMS
    for heads in heads_list:
        for b in batches:
            gen = torch.Generator(device=dev).manual_seed(0)
            pages = b * L // P + 4
            cache = torch.randn(pages, P, 576, device=dev, dtype=torch.bfloat16, generator=gen)
            table = torch.randperm(pages, device=dev, generator=gen)[: b * L // P].view(b, L // P).to(torch.int32)
            lens = torch.full((b,), L, device=dev, dtype=torch.int32)
            qn = torch.randn(b, heads, 512, device=dev, dtype=torch.bfloat16, generator=gen)
            qr = torch.randn(b, heads, 64, device=dev, dtype=torch.bfloat16, generator=gen)
            meta = plan_mla_decode(table, lens, P, num_heads=heads, kv_lora_rank=512, max_seqlen_k=L)
            ref = None
            caches = [("bf16", cache, 1.0, forms)]
            caches.append(
                (
                    "e4m3",
                    quantize_kv(cache, torch.float8_e4m3fn, 0.05),
                    0.05,
                    {"default": None, "wide 64-head block": WIDE_TILES},
                )
            )
            for kv_name, kv, kv_scale, kv_forms in caches:
                for name, tiles in kv_forms.items():
                    out = torch.empty_like(qn)

                    call = functools.partial(decode, qn, qr, kv, table, lens, out, meta, tiles, kv_scale)

                    try:
                        call()
                        torch.cuda.synchronize()
                    except Exception as err:  # a form that does not take this case says why
                        print(f"{heads} heads B={b} {kv_name} {name}: {type(err).__name__}: {str(err)[:160]}")
                        continue
                    if ref is None:
                        ref = out.float().clone()
                    diff = ((out.float() - ref).norm() / ref.norm()).item()
                    t = measure_graph(call, [0, 1], dev)
                    print(f"{heads} heads B={b} {kv_name} {name}: {t.median_ms:.4f} ms (spread {t.spread:.1%}), "
                          f"against the bf16 default {diff:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
