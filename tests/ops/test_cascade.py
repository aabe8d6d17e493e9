"""Cascade attention against plain paged attention over the full sequences (and the float64 reference).

Sequences share their first pages (``testing.share_prefix``: the pages they no longer own are
NaN), so a shared pass that read a request's own pages, or an own pass that read the shared
ones twice, would show.
"""

from __future__ import annotations

import pytest
import torch

import portattn
from conftest import DEVICE, backend_dtype_params
from portattn.testing import (
    lse_error,
    lse_tolerance,
    make_paged_case,
    max_error,
    paged_attention_ref,
    share_prefix,
    tolerance,
)

BACKEND_DTYPES = backend_dtype_params("merge_attention_states")


def shared_case(page_size, shared_pages, q_lens, own_lens, *, dtype, seed=0, **kwargs):
    shared = shared_pages * page_size
    k_lens = [shared + n for n in own_lens]
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=dtype, device=DEVICE, seed=seed, **kwargs)
    return share_prefix(case, shared), shared


def check_cascade(case, shared, backend, dtype, **kwargs):
    out, lse = portattn.cascade_attention(
        **case.inputs(), shared_prefix_len=shared, backend=backend, return_lse=True, **kwargs
    )
    ref, ref_lse = paged_attention_ref(**case.inputs(), return_lse=True, **kwargs)
    lowp = paged_attention_ref(**case.inputs(), upcast=False, **kwargs)
    assert out.dtype == dtype
    err, tol = max_error(out, ref), tolerance(ref, lowp, dtype)
    assert err <= tol, f"max error {err:.3e} > tolerance {tol:.3e}"
    assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, dtype)
    plain = portattn.paged_attention(**case.inputs(), backend=backend, **kwargs)
    assert max_error(out, plain) <= 2 * tol  # the same numbers as plain paged attention
    return out


CASES = {
    # page size, shared pages, new tokens per request, own keys per request (new tokens included)
    "decodes": (16, 2, [1, 1, 1, 1], [1, 15, 16, 17]),
    "page_size_1": (1, 9, [1, 1, 3], [1, 2, 5]),
    "odd_pages_extends": (3, 3, [1, 4, 2, 6], [1, 5, 3, 7]),
    "more_queries_than_shared_keys": (7, 1, [9, 8], [12, 8]),
    "nothing_shared": (5, 0, [1, 3], [6, 3]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_cascade_equals_paged_attention(backend, dtype, name):
    page_size, shared_pages, q_lens, own_lens = CASES[name]
    case, shared = shared_case(page_size, shared_pages, q_lens, own_lens, dtype=dtype, seed=len(name))
    check_cascade(case, shared, backend, dtype)


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_cascade_features(backend, dtype):
    case, shared = shared_case(4, 3, [1, 3, 1], [2, 5, 9], dtype=dtype, seed=7, num_q_heads=8, num_kv_heads=2)
    sinks = torch.linspace(-1.0, 2.0, 8, device=DEVICE).to(dtype)
    check_cascade(case, shared, backend, dtype, sinks=sinks, logit_softcap=5.0)  # sinks counted once
    check_cascade(case, shared, backend, dtype, causal=False, scale=0.3)


def test_cascade_with_float64_is_exact():
    case, shared = shared_case(8, 4, [1, 2, 5], [3, 2, 40], dtype=torch.float64, seed=1)
    out = portattn.cascade_attention(**case.inputs(), shared_prefix_len=shared, backend="torch")
    assert max_error(out, paged_attention_ref(**case.inputs())) <= 1e-13


def test_cascade_checks_the_shared_prefix():
    case, shared = shared_case(4, 2, [1, 2], [6, 7], dtype=torch.float32)
    assert shared == 8
    with pytest.raises(ValueError, match=r"expected shared_prefix_len a multiple of the page size 4"):
        portattn.cascade_attention(**case.inputs(), shared_prefix_len=6)
    with pytest.raises(ValueError, match=r"expected page_table rows that share their first 3 pages"):
        portattn.cascade_attention(**case.inputs(), shared_prefix_len=12)  # row 1's third page is its own
    seq_lens_k = torch.tensor([14, 9], dtype=torch.int32, device=DEVICE)  # sequence 1's 2 new tokens: keys 7, 8
    with pytest.raises(ValueError, match=r"expected sequence 1's 2 new tokens past the shared prefix"):
        portattn.cascade_attention(**{**case.inputs(), "seq_lens_k": seq_lens_k}, shared_prefix_len=8)
    with pytest.raises(ValueError, match=r"expected shared_prefix_len to be an int >= 0"):
        portattn.cascade_attention(**case.inputs(), shared_prefix_len=-4)


def test_share_prefix_poisons_the_pages_it_replaces():
    case = make_paged_case([1, 1], [9, 9], page_size=3, device=DEVICE)
    shared = share_prefix(case, 6)
    old = case.page_table[1, :2].long()
    assert torch.isnan(shared.k_cache[old]).all() and torch.isnan(shared.v_cache[old]).all()
    assert torch.equal(shared.page_table[1, :2], shared.page_table[0, :2])
    assert torch.equal(shared.page_table[:, 2:], case.page_table[:, 2:])


def test_the_cascade_benchmark_runs_a_tiny_case():
    from portattn.bench.cascade import CascadeCase, run_case

    case = CascadeCase("tiny", 3, 8, 5, q_len=2, page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32)
    result = run_case(case, torch.device("cpu"), dtype=torch.float32, backend="torch", runs=2)
    assert result["max_abs_diff_vs_plain"] <= 1e-5
    assert set(result["ms"]) == {"plain", "cascade", "shared_pass", "own_pass", "merge", "plain_distinct"}
    assert result["kv_bytes"] == {"plain": 3 * 13 * 2 * 2 * 32 * 4, "cascade": (8 + 3 * 5) * 2 * 2 * 32 * 4}
