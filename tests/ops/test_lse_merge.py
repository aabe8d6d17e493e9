"""``return_lse`` of the ops and ``merge_attention_states``, against the float64 reference.

The merge is checked the way it is used: attention over a union of disjoint key sets must equal
the merge of the attentions over the parts (exactly, up to rounding, in float64).
"""

from __future__ import annotations

import math

import pytest
import torch

import portattn
from conftest import BACKENDS, DEVICE, backend_dtype_params
from portattn import UnsupportedFeatureError
from portattn.testing import (
    cu_seqlens,
    lse_error,
    lse_tolerance,
    make_paged_case,
    max_error,
    mla_decode_ref,
    paged_attention_ref,
    tolerance,
    varlen_attention_ref,
)

PAGED = backend_dtype_params("paged_attention")
VARLEN = backend_dtype_params("varlen_attention")
MERGE = backend_dtype_params("merge_attention_states")
SLOPES = [0.5, 0.25, 0.0625, 0.0078125]  # 2^-1, 2^-2, 2^-4, 2^-7: BLOOM-like, one per query head


def check_paged_lse(case, backend, dtype, **kwargs):
    out, lse = portattn.paged_attention(**case.inputs(), backend=backend, return_lse=True, **kwargs)
    ref, ref_lse = paged_attention_ref(**case.inputs(), return_lse=True, **kwargs)
    lowp = paged_attention_ref(**case.inputs(), upcast=False, **kwargs)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == case.q.shape[:2]
    assert max_error(out, ref) <= tolerance(ref, lowp, dtype)
    err, tol = lse_error(lse, ref_lse), lse_tolerance(ref_lse, dtype)
    assert err <= tol, f"lse error {err:.3e} > {tol:.3e}"
    return out, lse


LSE_FEATURES = {
    "causal": {},
    "window_chunk": {"window_left": 5, "attention_chunk_size": 8},
    "sinks_softcap": {"sinks": "sinks", "logit_softcap": 4.0},
    "alibi": {"alibi_slopes": "slopes"},
    "non_causal_window_right": {"causal": False, "window_left": 4, "window_right": 2},
}


def _resolve(kwargs: dict, dtype: torch.dtype) -> dict:
    kwargs = dict(kwargs)
    if kwargs.get("sinks") == "sinks":
        kwargs["sinks"] = torch.tensor([-2.0, 0.5, 1.5, 4.0], device=DEVICE).to(dtype)
    if kwargs.get("alibi_slopes") == "slopes":
        kwargs["alibi_slopes"] = torch.tensor(SLOPES, device=DEVICE)
    return kwargs


@pytest.mark.parametrize(("feature", "page_size"), list(zip(LSE_FEATURES, [16, 1, 7, 3, 5])))
@pytest.mark.parametrize(("backend", "dtype"), PAGED)
def test_paged_lse(backend, dtype, feature, page_size):
    p = page_size
    k_lens = [1, p + 1, 3 * p + 5, 2 * p + 3]
    q_lens = [1, 1, 6, 2 * p + 3]
    case = make_paged_case(q_lens, k_lens, page_size=p, dtype=dtype, device=DEVICE, seed=p)
    check_paged_lse(case, backend, dtype, **_resolve(LSE_FEATURES[feature], dtype))


@pytest.mark.parametrize(("backend", "dtype"), VARLEN)
def test_varlen_lse_and_rows_that_see_no_key(backend, dtype):
    # Fewer keys than queries, causal: the first 4 queries of sequence 0 see nothing (-inf, zeros);
    # with sinks their LSE is the sink itself (the only term of the denominator), output still 0.
    gen = torch.Generator().manual_seed(0)
    q_lens, k_lens = [6, 3, 0, 5], [2, 9, 4, 5]
    q = torch.randn(sum(q_lens), 4, 64, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(sum(k_lens), 2, 64, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(sum(k_lens), 2, 64, generator=gen).to(dtype).to(DEVICE)
    args = (q, k, v, cu_seqlens(q_lens, DEVICE), cu_seqlens(k_lens, DEVICE))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE).to(dtype)
    slopes = torch.tensor(SLOPES, device=DEVICE)
    for kwargs in ({}, {"sinks": sinks}, {"alibi_slopes": slopes, "window_size": (3, 2)}):
        try:
            out, lse = portattn.varlen_attention(*args, causal=True, backend=backend, return_lse=True, **kwargs)
        except UnsupportedFeatureError as exc:
            assert backend == "sdpa" and "'torch'" in str(exc)
            continue
        _, ref_lse = varlen_attention_ref(*args, causal=True, return_lse=True, **kwargs)
        assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, dtype)  # -inf exactly where the reference has it
        assert torch.count_nonzero(out[:4]) == 0
        assert torch.isfinite(lse[:4]).all() if "sinks" in kwargs else torch.isneginf(lse[:4]).all()
        assert torch.isfinite(lse[4:]).all()


@pytest.mark.parametrize("backend", [b for b in ("torch", "triton") if b in BACKENDS])
def test_mla_decode_lse(backend):
    gen = torch.Generator().manual_seed(1)
    rank, rope, page_size, lens = 32, 16, 5, [0, 7, 40, 1]
    kv_cache = torch.randn(40, page_size, rank + rope, generator=gen).to(DEVICE)
    page_table = torch.randperm(40, generator=gen)[:32].view(4, 8).int().to(DEVICE)
    q_nope = torch.randn(4, 4, rank, generator=gen).to(DEVICE)
    q_rope = torch.randn(4, 4, rope, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q_nope, q_rope, kv_cache, page_table, seq_lens)
    ref, ref_lse = mla_decode_ref(*args, scale=0.2, return_lse=True)
    for splits in (1, 3):  # the kernel's own LSE, and the merge's
        out, lse = portattn.mla_decode(*args, scale=0.2, num_kv_splits=splits, backend=backend, return_lse=True)
        assert max_error(out, ref) <= 1e-5
        assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, torch.float32)
        assert torch.isneginf(lse[0]).all()


def _union_case(dtype, seed=0, num_keys=(13, 1, 40), parts=3):
    """Queries over keys split at random into ``parts`` disjoint sets (empty sets included)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(num_keys) * 2, 4, 48, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(sum(num_keys), 2, 48, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(sum(num_keys), 2, 24, generator=gen).to(dtype).to(DEVICE)
    owner = torch.randint(0, parts, (sum(num_keys),), generator=gen)
    owner[:2] = parts - 1  # some sequence-part pairs stay empty: sequence 1 has its one key in the last part
    cu_q = cu_seqlens([2] * len(num_keys), DEVICE)
    return q, k, v, cu_q, num_keys, owner


def _part(q, k, v, cu_q, num_keys, owner, i, backend, **kwargs):
    """Non-causal varlen attention of every sequence's queries over its keys owned by part ``i``."""
    starts = [0, *torch.tensor(num_keys).cumsum(0).tolist()]
    index = [j for b in range(len(num_keys)) for j in range(starts[b], starts[b + 1]) if owner[j] == i]
    lens = [sum(1 for j in range(starts[b], starts[b + 1]) if owner[j] == i) for b in range(len(num_keys))]
    index = torch.tensor(index, dtype=torch.long, device=DEVICE)
    return portattn.varlen_attention(
        q, k[index], v[index], cu_q, cu_seqlens(lens, DEVICE), backend=backend, return_lse=True, **kwargs
    )


def test_merge_is_exact_in_float64():
    q, k, v, cu_q, num_keys, owner = _union_case(torch.float64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, device=DEVICE)
    whole, whole_lse = portattn.varlen_attention(
        q, k, v, cu_q, cu_seqlens(list(num_keys), DEVICE), sinks=sinks, backend="torch", return_lse=True
    )
    parts = [
        _part(q, k, v, cu_q, num_keys, owner, i, "torch", **({"sinks": sinks} if i == 0 else {})) for i in range(3)
    ]
    assert any(bool(torch.isneginf(lse).any()) for _, lse in parts)  # an empty part is in there
    out, lse = portattn.merge_attention_states(*[t for part in parts for t in part])
    assert out.dtype == lse.dtype == torch.float64
    assert max_error(out, whole) <= 1e-13 and lse_error(lse, whole_lse) <= 1e-13
    # Two parts at a time give the same.
    first, first_lse = portattn.merge_attention_states(*parts[0], *parts[1])
    out2, lse2 = portattn.merge_attention_states(first, first_lse, *parts[2])
    assert max_error(out2, whole) <= 1e-13 and lse_error(lse2, whole_lse) <= 1e-13


@pytest.mark.parametrize(("backend", "dtype"), MERGE)
def test_merge_backends_against_the_union(backend, dtype):
    q, k, v, cu_q, num_keys, owner = _union_case(dtype, seed=2)
    cu_k = cu_seqlens(list(num_keys), DEVICE)
    ref, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, return_lse=True)
    lowp = varlen_attention_ref(q, k, v, cu_q, cu_k, upcast=False)
    parts = [_part(q, k, v, cu_q, num_keys, owner, i, "torch") for i in range(3)]
    out, lse = portattn.merge_attention_states(*[t for part in parts for t in part], backend=backend)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # Each part is rounded to the dtype once, the merge once more.
    assert max_error(out, ref) <= 2 * tolerance(ref, lowp, dtype)
    assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, dtype)


@pytest.mark.parametrize(("backend", "dtype"), MERGE)
def test_merge_ignores_parts_that_saw_nothing(backend, dtype):
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 3, 40, generator=gen).to(dtype).to(DEVICE)
    lse_a = torch.randn(5, 3, generator=gen).to(DEVICE)
    b = torch.full_like(a, float("nan"))  # nothing seen: the output may hold anything
    lse_b = torch.full_like(lse_a, float("-inf"))
    lse_a[0] = float("-inf")  # row 0: no part saw a key
    out, lse = portattn.merge_attention_states(a, lse_a, b, lse_b, backend=backend)
    assert torch.equal(out[1:].cpu(), a[1:].cpu()) and lse_error(lse, lse_a) <= 1e-6
    a[0] = float("nan")
    out, lse = portattn.merge_attention_states(b, lse_b, a, lse_a, backend=backend)
    assert torch.count_nonzero(out[0]) == 0 and torch.isneginf(lse[0]).all()
    assert torch.equal(out[1:].cpu(), a[1:].cpu()) and lse_error(lse, lse_a) <= 1e-6


@pytest.mark.parametrize(("backend", "dtype"), MERGE)
def test_merge_strided_inputs_and_output_into_a_part(backend, dtype):
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randn(6, 4, 32, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    lse_a = torch.randn(4, 6, generator=gen).to(DEVICE).T  # [T, H] view of an [H, T] layout (vLLM's)
    lse_b = torch.randn(6, 4, generator=gen).to(DEVICE)
    a_wide = torch.zeros(6, 5, 32, dtype=dtype, device=DEVICE)
    a_wide[:, :4] = a
    expected, expected_lse = portattn.merge_attention_states(a, lse_a.contiguous(), b, lse_b, backend="torch")
    out, lse = portattn.merge_attention_states(a_wide[:, :4], lse_a, b, lse_b, backend=backend, out=a_wide[:, :4])
    assert out.data_ptr() == a_wide.data_ptr()
    ulp = torch.finfo(dtype).eps * float(expected.abs().max())
    assert max_error(a_wide[:, :4], expected) <= ulp and lse_error(lse, expected_lse) <= 1e-6


def test_merge_checks_its_inputs():
    a = torch.zeros(3, 2, 8, device=DEVICE)
    lse = torch.zeros(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="expected outputs and LSEs in pairs"):
        portattn.merge_attention_states(a, lse, a, lse, a)
    with pytest.raises(ValueError, match=r"expected out_b of shape \[3, 2, 8\]"):
        portattn.merge_attention_states(a, lse, a[:2], lse)
    with pytest.raises(ValueError, match="expected out_b of dtype float32"):
        portattn.merge_attention_states(a, lse, a.half(), lse)
    with pytest.raises(ValueError, match=r"expected lse_b of shape \[3, 2\]"):
        portattn.merge_attention_states(a, lse, a, lse.T)
    with pytest.raises(ValueError, match="expected lse_a of dtype float32 or float64"):
        portattn.merge_attention_states(a, lse.half(), a, lse)
    with pytest.raises(UnsupportedFeatureError, match=r"does not support the merge_attention_states op.*'torch'"):
        portattn.merge_attention_states(a, lse, a, lse, backend="sdpa")


def test_sdpa_refuses_lse_and_alibi_naming_the_backends_that_have_them():
    q = torch.randn(5, 4, 32, device=DEVICE)
    cu = cu_seqlens([5], DEVICE)
    names = "'torch', 'triton'" if "triton" in BACKENDS else "'torch'"
    with pytest.raises(UnsupportedFeatureError, match=f"log-sum-exp.*{names}"):
        portattn.varlen_attention(q, q, q, cu, backend="sdpa", return_lse=True)
    with pytest.raises(UnsupportedFeatureError, match=f"ALiBi.*{names}"):
        portattn.varlen_attention(q, q, q, cu, backend="sdpa", alibi_slopes=torch.ones(4, device=DEVICE))


def test_lse_is_the_log_of_the_softmax_denominator():
    # One query, two keys, known logits: lse = log(e^a + e^b) (+ e^sink).
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64, device=DEVICE)  # [1, 1, 2]
    k = torch.tensor([[[2.0, 0.0]], [[-1.0, 3.0]]], dtype=torch.float64, device=DEVICE)  # [2, 1, 2]
    cu_q, cu_k = cu_seqlens([1], DEVICE), cu_seqlens([2], DEVICE)
    _, lse = portattn.varlen_attention(q, k, k, cu_q, cu_k, scale=1.0, backend="torch", return_lse=True)
    assert float(lse) == pytest.approx(math.log(math.exp(2.0) + math.exp(-1.0)), rel=1e-15)
    sinks = torch.tensor([0.5], dtype=torch.float64, device=DEVICE)
    _, lse = portattn.varlen_attention(q, k, k, cu_q, cu_k, scale=1.0, sinks=sinks, backend="torch", return_lse=True)
    assert float(lse) == pytest.approx(math.log(math.exp(2.0) + math.exp(-1.0) + math.exp(0.5)), rel=1e-15)
    slopes = torch.tensor([0.75], dtype=torch.float64, device=DEVICE)  # query at position 1: key 0 is 1 away
    _, lse = portattn.varlen_attention(
        q, k, k, cu_q, cu_k, scale=1.0, alibi_slopes=slopes, backend="torch", return_lse=True
    )
    assert float(lse) == pytest.approx(math.log(math.exp(2.0 - 0.75) + math.exp(-1.0)), rel=1e-15)
