"""The split merge inside the output projection (``fused_launch.merge_linear``): an attention launch's
unmerged splits (``attention_forward(unmerged=...)``) merged and projected in one launch equal the
merged attention times the weight, and the float64 reference times it; splits that saw no key (short
sequences over many splits) and NaN in the buffers before the launch change nothing. On the CPU
through Triton's interpreter in float16, on a GPU bfloat16 too."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.testing import make_paged_case, paged_attention_ref

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type != "cpu" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value_dim", [32, 40])  # a power of two, and one the partials pad to 64
@pytest.mark.parametrize("splits", [2, 4])
def test_merge_linear_equals_the_merge_then_the_projection(dtype, value_dim, splits):
    from portattn.kernels.triton.fused_launch import merge_linear
    from portattn.kernels.triton.launch import attention_forward, next_pow2

    k_lens = [1, 6, 33, 90]  # one key over 4 splits leaves three empty
    case = make_paged_case([1] * len(k_lens), k_lens, page_size=7, num_q_heads=6, num_kv_heads=2, head_dim=32,
                           value_dim=value_dim, dtype=dtype, device=DEVICE, seed=splits)  # fmt: skip
    args = dict(max_seqlen_q=1, scale=0.2, page_table=case.page_table, num_kv_splits=splits)
    rows, heads = len(k_lens), 6
    merged = torch.empty(rows, heads, value_dim, dtype=dtype, device=DEVICE)
    attention_forward(case.q, case.k_cache, case.v_cache, merged, case.cu_seqlens_q, case.seq_lens_k, **args)
    partials = (torch.full((rows, heads, splits, next_pow2(value_dim)), float("nan"), device=DEVICE),
                torch.full((rows, heads, splits), float("nan"), device=DEVICE))  # fmt: skip
    untouched = torch.full_like(merged, 7.0)
    attention_forward(
        case.q, case.k_cache, case.v_cache, untouched, case.cu_seqlens_q, case.seq_lens_k, unmerged=partials, **args
    )
    assert bool((untouched == 7.0).all())  # the splits stay unmerged: out is not written
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(24, heads * value_dim, generator=g) / (heads * value_dim) ** 0.5).to(DEVICE, dtype)
    got = merge_linear(*partials, weight)
    assert got.shape == (rows, 24) and got.dtype == dtype
    plain = (merged.flatten(1).float() @ weight.float().T).to(dtype)  # the merge kernel, then the product
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.page_table, case.cu_seqlens_q,
                              case.seq_lens_k, scale=0.2).double().flatten(1) @ weight.double().T  # fmt: skip
    eps = torch.finfo(dtype).eps
    scale = float(ref.abs().max())
    assert float((got.double() - plain.double()).abs().max()) <= 4 * eps * scale  # the same values, summed apart
    assert float((got.double() - ref).abs().max()) <= 16 * eps * scale


def test_merge_linear_names_what_it_takes():
    from portattn.kernels.triton.fused_launch import merge_linear

    out, lse = torch.zeros(2, 4, 2, 32, device=DEVICE), torch.zeros(2, 4, 2, device=DEVICE)
    with pytest.raises(ValueError, match=r"partials \[T, Hq, S, next_pow2\(Dv\)\]"):
        merge_linear(out, lse, torch.zeros(8, 99, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="at most 8192 padded heads x splits x value columns"):
        big = torch.zeros(1, 32, 64, 128, device=DEVICE), torch.zeros(1, 32, 64, device=DEVICE)
        merge_linear(*big, torch.zeros(8, 32 * 128, dtype=torch.float16, device=DEVICE))
