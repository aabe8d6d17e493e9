"""The reference kernels of ``scripts/kernels_probe.py prefill`` (a causal prefill with tensor-descriptor
loads, and the same with pointer loads) against float64: the probe compares the paged kernel's speed
with theirs, so they must compute the same attention (GQA, 4 query heads per KV head)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import BACKENDS, DEVICE

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import kernels_probe
    finally:
        sys.path.remove(str(SCRIPTS))
    return kernels_probe


def causal_reference(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vf)


@pytest.mark.parametrize("kernel", ["descriptors", "pointers"])
def test_the_probe_kernels_equal_the_float64_reference(probe, kernel):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    length, hq, hkv, d = 128, 8, 2, 64
    q, k, v = (torch.randn(length, h, d, generator=gen, device=DEVICE, dtype=torch.float16) for h in (hq, hkv, hkv))
    out = torch.full_like(q, float("nan"))
    run = probe.tma_prefill if kernel == "descriptors" else probe.pointer_prefill
    run(q, k, v, out, d**-0.5, 32, 16, 4, 2)
    ref = causal_reference(q, k, v, d**-0.5)
    assert (out.double() - ref).abs().max() < 2e-3
