"""The host's time of one eager ``mla_decode_forward`` call (64 sequences over 4096 keys, page 64): wall time a call
over 200 calls with the device kept busy, and cProfile's 25 largest cumulative entries for e4m3 at 64 heads:
``PYTHONPATH=src python3 host.py``."""

import cProfile
import pstats
import time

import torch

from portattn.kernels.triton import mla_decode_launch
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode

dev = torch.device("cuda")
b, L, P = 64, 4096, 64
gen = torch.Generator(device=dev).manual_seed(0)
pages = b * L // P
cache = torch.randn(pages, P, 576, device=dev, dtype=torch.bfloat16, generator=gen)
table = torch.randperm(pages, device=dev, generator=gen).view(b, L // P).to(torch.int32)
lens = torch.full((b,), L, device=dev, dtype=torch.int32)
for name in ("bf16", "e4m3"):
    kv, kv_scale = (cache, 1.0) if name == "bf16" else (quantize_kv(cache, torch.float8_e4m3fn, 0.05), 0.05)
    for heads in (17, 64, 128):
        qn = torch.randn(b, heads, 512, device=dev, dtype=torch.bfloat16, generator=gen)
        qr = torch.randn(b, heads, 64, device=dev, dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(qn)
        meta = plan_mla_decode(table, lens, P, num_heads=heads, kv_lora_rank=512, max_seqlen_k=L)

        def call(qn=qn, qr=qr, kv=kv, out=out, meta=meta, kv_scale=kv_scale):
            mla_decode_launch.mla_decode_forward(qn, qr, kv, table, lens, out, scale=0.07,
                                                 num_kv_splits=meta.num_kv_splits, partials=meta.partials,
                                                 kv_scale=kv_scale, fewer_splits=meta.splits_chosen)  # fmt: skip

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            call()
        host = (time.perf_counter() - t) / 200
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 200
        print(f"{name} heads {heads}: host {host * 1e3:.4f} ms a call, wall {wall * 1e3:.4f} ms a call", flush=True)
        if name == "e4m3" and heads == 64:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                call()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
