"""The two ceilings every case is compared with, measured in the same run as the cases."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .timing import measure


@dataclass(frozen=True)
class Ceilings:
    copy_tb_s: float  # device-to-device copy, bytes read + bytes written
    matmul_tflop_s: float  # bf16 8192^3 matrix product on random data


def measure_ceilings(device: torch.device, *, copy_bytes: int = 1 << 30, n: int = 8192) -> Ceilings:
    srcs = [torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device=device) for _ in range(2)]
    pairs = [(src, torch.empty_like(src)) for src in srcs]
    copy = measure(lambda pair: pair[1].copy_(pair[0]), pairs, device, runs=30)
    del srcs, pairs
    mats = [tuple(torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2)) for _ in range(2)]
    mm = measure(lambda ab: ab[0] @ ab[1], mats, device, runs=30)
    return Ceilings(
        copy_tb_s=2 * copy_bytes / (copy.median_ms * 1e-3) / 1e12,
        matmul_tflop_s=2 * n**3 / (mm.median_ms * 1e-3) / 1e12,
    )
