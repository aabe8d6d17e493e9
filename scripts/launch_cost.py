"""The host's time per launch of the attention kernel on a GPU: ``attention_forward`` without and with a
plan's memo (a repeated layer's launch), Triton's own ``kernel[grid](...)`` alone, and a
:class:`~portattn.kernels.triton.fast_launch.RepeatLaunch` of it (B=1 over 64 keys: the device time is a
few microseconds, so the loop times the host).

``PYTHONPATH=src python scripts/launch_cost.py`` from the repository root.
"""

from __future__ import annotations

import time

import torch

import portattn.kernels.triton.launch as launch
from portattn.kernels.triton.fast_launch import RepeatLaunch


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    dev, page, keys, dim = "cuda", 16, 64, 128
    torch.manual_seed(0)
    q = torch.randn(1, 32, dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(64, page, 8, dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    cu = torch.arange(2, dtype=torch.int32, device=dev)
    lens = torch.full((1,), keys, dtype=torch.int32, device=dev)
    table = torch.arange(keys // page, dtype=torch.int32, device=dev).view(1, -1)

    def call(memo=None, into=out):
        launch.attention_forward(q, k, v, into, cu, lens, max_seqlen_q=1, scale=0.1, page_table=table,
                                 max_seqlen_k=keys, memo=memo)  # fmt: skip

    print(f"attention_forward, no memo: {per_call_us(call):.1f} us")
    memo = {}
    print(f"attention_forward, memo hit: {per_call_us(lambda: call(memo)):.1f} us")
    real, seen = launch.attention_fwd_kernel, {}

    class Recorder:  # the kernel, recording the arguments of its launch
        def __getattr__(self, name):
            return getattr(real, name)

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
                return real[grid](*args, **kwargs)

            return run

    launch.attention_fwd_kernel = Recorder()
    try:
        call()
    finally:
        launch.attention_fwd_kernel = real
    grid, args, kwargs = seen["grid"], seen["args"], seen["kwargs"]
    print(f"Triton kernel[grid](...) alone: {per_call_us(lambda: real[grid](*args, **kwargs)):.1f} us")
    repeat = RepeatLaunch(real, grid, args, kwargs)
    kept = repeat.runner is not None
    print(f"RepeatLaunch.again (compiled kernel kept: {kept}): {per_call_us(lambda: repeat.again(args)):.1f} us")
    fresh = torch.empty_like(out)
    call(into=fresh)
    repeat.again(args)
    print("same result as a fresh launch:", torch.equal(out, fresh))


if __name__ == "__main__":
    main()
