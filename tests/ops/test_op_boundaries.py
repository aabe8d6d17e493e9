"""The ops refuse bad arguments before any arithmetic, follow one rule for queries beyond the keys,
return zeros for batches without keys, and make the page-table mix-up easy to catch."""

from __future__ import annotations

import pytest
import torch

import portattn
from conftest import DEVICE, backend_dtype_params
from portattn import PageTable, to_page_table
from portattn.testing import (
    cu_seqlens,
    gather_sequence,
    lse_error,
    lse_tolerance,
    make_paged_case,
    max_error,
    paged_attention_ref,
    tolerance,
    varlen_attention_ref,
)

PAGED = backend_dtype_params("paged_attention")
MLA = [p for p in backend_dtype_params("mla_decode") if p.values[1] != torch.bfloat16]


def paged_args(**changes) -> dict:
    case = make_paged_case([1, 3], [5, 3], page_size=2, dtype=torch.float32)
    return {**case.inputs(), "backend": "torch", **changes}


I32 = torch.int32
PAGED_REFUSALS = [
    ("softcap-inf", {"logit_softcap": float("inf")}, "expected a finite logit_softcap, got inf"),
    ("softcap-bool", {"logit_softcap": True}, "expected logit_softcap >= 0"),
    ("window-bool", {"window_left": True}, "expected window_left to be an int >= -1, got True"),
    ("chunk-bool", {"attention_chunk_size": True}, "expected attention_chunk_size to be None or a positive int"),
    ("causal-int", {"causal": 1}, "expected causal to be a bool, got 1"),
    ("scale-bool", {"scale": True}, "expected a positive finite scale, got True"),
    (
        "lens-negative",
        {"seq_lens_k": torch.tensor([5, -1], dtype=I32)},
        r"expected seq_lens_k >= 0, got seq_lens_k\[1\]",
    ),
]


@pytest.mark.parametrize(("changes", "message"), [pytest.param(c, m, id=i) for i, c, m in PAGED_REFUSALS])
def test_paged_attention_refuses(changes, message):
    with pytest.raises(ValueError, match=message):
        portattn.paged_attention(**paged_args(**changes))


def test_zero_sizes_are_refused_before_any_division():
    q = torch.randn(4, 4, 0)
    k = torch.randn(8, 2, 2, 0)
    table, cu, lens = torch.zeros(2, 3, dtype=I32), cu_seqlens([1, 3]), torch.tensor([5, 3], dtype=I32)
    with pytest.raises(ValueError, match=r"expected head dim \(q.shape\[2\]\) >= 1, got 0"):
        portattn.paged_attention(q, k, k, table, cu, lens)
    k = torch.randn(8, 0, 2, 16)
    with pytest.raises(ValueError, match=r"expected page size \(k_cache.shape\[1\]\) >= 1, got 0"):
        portattn.paged_attention(torch.randn(4, 4, 16), k, k, table, cu, lens)
    k, v = torch.randn(8, 2, 2, 16), torch.randn(8, 2, 2, 0)
    with pytest.raises(ValueError, match=r"expected value head dim \(v_cache.shape\[3\]\) >= 1, got 0"):
        portattn.paged_attention(torch.randn(4, 4, 16), k, v, table, cu, lens)
    with pytest.raises(ValueError, match=r"expected head dim \(q.shape\[2\]\) >= 1, got 0"):
        portattn.varlen_attention(torch.randn(4, 4, 0), torch.randn(4, 2, 0), torch.randn(4, 2, 8), cu_seqlens([4]))
    kv = torch.randn(3, 0, 48)
    with pytest.raises(ValueError, match=r"expected page size \(kv_cache.shape\[1\]\) >= 1, got 0"):
        portattn.mla_decode(torch.randn(2, 4, 32), torch.randn(2, 4, 16), kv, table, lens, scale=0.1)


def test_varlen_blames_the_tensor_that_is_wrong():
    q, k, cu = torch.randn(5, 4, 16), torch.randn(5, 2, 16), cu_seqlens([5])
    with pytest.raises(
        ValueError, match=r"expected v of shape \[5, 2, Dv >= 1\] \(keys and heads as k\), got \[6, 2, 8\]"
    ):
        portattn.varlen_attention(q, k, torch.randn(6, 2, 8), cu)
    with pytest.raises(ValueError, match=r"expected k of shape \[6, 2, 16\]"):
        portattn.varlen_attention(q, torch.randn(6, 2, 8), torch.randn(6, 2, 8), cu)
    with pytest.raises(ValueError, match="expected max_seqlen_q >= 5, got True"):
        portattn.varlen_attention(q, k, torch.randn(5, 2, 8), cu, max_seqlen_q=True)
    with pytest.raises(ValueError, match="expected window_left to be an int >= -1, got True"):
        portattn.varlen_attention(q, k, torch.randn(5, 2, 8), cu, window_size=(True, -1))


def test_mla_decode_refuses_a_bool_scale():
    kv, table, lens = torch.randn(3, 4, 48), torch.zeros(2, 1, dtype=I32), torch.ones(2, dtype=I32)
    with pytest.raises(ValueError, match="expected a positive finite scale, got True"):
        portattn.mla_decode(torch.randn(2, 4, 32), torch.randn(2, 4, 16), kv, table, lens, scale=True)


# -- queries beyond the keys -------------------------------------------------------------------

BEYOND = {
    "causal": {},
    "window": {"window_left": 1},
    "chunk": {"attention_chunk_size": 4},
    "non_causal": {"causal": False},
}


@pytest.mark.parametrize("feature", list(BEYOND))
@pytest.mark.parametrize(("backend", "dtype"), PAGED)
def test_paged_queries_beyond_the_keys_follow_varlen(backend, dtype, feature):
    # Bottom-right aligned: the first n - L queries sit at negative positions. A sequence with no key.
    q_lens, k_lens = [4, 1, 3, 6, 2], [2, 0, 3, 9, 1]
    case = make_paged_case(q_lens, k_lens, page_size=4, dtype=dtype, device=DEVICE, seed=3)
    kwargs = BEYOND[feature]
    out, lse = portattn.paged_attention(**case.inputs(), backend=backend, return_lse=True, **kwargs)
    ref, ref_lse = paged_attention_ref(**case.inputs(), return_lse=True, **kwargs)
    assert max_error(out, ref) <= tolerance(ref, paged_attention_ref(**case.inputs(), upcast=False, **kwargs), dtype)
    assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, dtype)  # -inf where no key is seen
    blind = [0, 1, 4, 14] if kwargs.get("causal", True) else [4]  # rows that see no key
    assert torch.count_nonzero(out[blind]) == 0
    k = torch.cat([gather_sequence(case.k_cache, case.page_table[b], n) for b, n in enumerate(k_lens)])
    v = torch.cat([gather_sequence(case.v_cache, case.page_table[b], n) for b, n in enumerate(k_lens)])
    varlen_kwargs = {"causal": kwargs.get("causal", True), "window_size": (kwargs.get("window_left", -1), -1)}
    if "attention_chunk_size" not in kwargs:  # the same rule as varlen_attention
        args = (case.q, k, v, case.cu_seqlens_q, cu_seqlens(k_lens, DEVICE))
        assert max_error(out, varlen_attention_ref(*args, **varlen_kwargs)) <= tolerance(ref, ref.to(dtype), dtype) * 4


@pytest.mark.parametrize(("backend", "dtype"), PAGED)
def test_paged_sinks_with_queries_beyond_the_keys(backend, dtype):
    case = make_paged_case([3, 2], [1, 0], page_size=2, dtype=dtype, device=DEVICE, seed=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE).to(dtype)
    out, lse = portattn.paged_attention(**case.inputs(), sinks=sinks, backend=backend, return_lse=True)
    ref, ref_lse = paged_attention_ref(**case.inputs(), sinks=sinks, return_lse=True)
    assert max_error(out, ref) <= tolerance(ref, paged_attention_ref(**case.inputs(), sinks=sinks, upcast=False), dtype)
    assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, dtype)  # the sink alone where no key is seen
    assert torch.count_nonzero(out[[0, 1, 3, 4]]) == 0


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize(("backend", "dtype"), PAGED)
def test_a_decode_without_keys_beside_others_is_zeros(backend, dtype, sinks):
    # A decode batch (one query per sequence) where one sequence has no key: the torch backend
    # attends such batches padded together, and the empty one's row must still come out zero.
    case = make_paged_case([1, 1, 1], [5, 0, 9], page_size=4, dtype=dtype, device=DEVICE, seed=6)
    kwargs = {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE).to(dtype)} if sinks else {}
    out, lse = portattn.paged_attention(**case.inputs(), backend=backend, return_lse=True, **kwargs)
    ref, ref_lse = paged_attention_ref(**case.inputs(), return_lse=True, **kwargs)
    assert max_error(out, ref) <= tolerance(ref, paged_attention_ref(**case.inputs(), upcast=False, **kwargs), dtype)
    assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, dtype)  # -inf, or the sink alone, for the empty one
    assert torch.count_nonzero(out[1]) == 0


# -- batches without keys ----------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "dtype"), MLA)
@pytest.mark.parametrize(("num_pages", "width"), [(3, 0), (0, 1), (0, 0)], ids=["no-columns", "no-pages", "neither"])
def test_mla_decode_of_an_all_empty_batch_is_zeros(backend, dtype, num_pages, width):
    q_nope = torch.randn(2, 4, 32, device=DEVICE).to(dtype)
    q_rope = torch.randn(2, 4, 16, device=DEVICE).to(dtype)
    kv = torch.randn(num_pages, 4, 48, device=DEVICE).to(dtype)
    table, lens = torch.zeros(2, width, dtype=I32, device=DEVICE), torch.zeros(2, dtype=I32, device=DEVICE)
    out = portattn.mla_decode(q_nope, q_rope, kv, table, lens, scale=0.1, backend=backend)
    assert out.shape == (2, 4, 32) and torch.count_nonzero(out) == 0


@pytest.mark.parametrize(("backend", "dtype"), PAGED)
def test_paged_attention_of_an_all_empty_batch_is_zeros(backend, dtype):
    q = torch.randn(3, 4, 64, device=DEVICE).to(dtype)
    k = torch.randn(0, 4, 2, 64, device=DEVICE).to(dtype)
    table, lens = torch.zeros(2, 0, dtype=I32, device=DEVICE), torch.zeros(2, dtype=I32, device=DEVICE)
    out = portattn.paged_attention(q, k, k, table, cu_seqlens([2, 1], DEVICE), lens, backend=backend)
    assert out.shape == (3, 4, 64) and torch.count_nonzero(out) == 0


# -- the page-table mix-up ---------------------------------------------------------------------


def token_table_case():
    """Two sequences in low-numbered pages of a 64-page pool (page size 4): their token-granular
    rows hold slots 0..31, every one of them also a valid page id."""
    page_size = 4
    pages = [[2, 5, 1], [7, 3]]
    k_lens = [10, 7]
    case = make_paged_case([1, 2], k_lens, page_size=page_size, spare_pages=60, dtype=torch.float64)
    k_cache, v_cache = torch.randn_like(case.k_cache), torch.randn_like(case.v_cache)
    page_table = torch.tensor([pages[0], pages[1] + [0]], dtype=I32)
    slots = torch.arange(page_size, dtype=I32)
    token_rows = torch.stack([(page_table[b, :, None] * page_size + slots).flatten()[:10] for b in range(2)])
    inputs = dict(case.inputs(), k_cache=k_cache, v_cache=v_cache, page_table=page_table)
    return inputs, token_rows, page_size


def test_the_token_table_mix_up_runs_silently_without_check():
    inputs, token_rows, _ = token_table_case()
    out = portattn.paged_attention(**{**inputs, "page_table": token_rows}, backend="torch")
    assert max_error(out, paged_attention_ref(**inputs)) > 0.1  # the trap: valid ids, wrong pages


@pytest.mark.parametrize("how", ["check", "env"])
def test_check_mode_catches_the_token_table_mix_up(how, monkeypatch):
    inputs, token_rows, _ = token_table_case()
    kwargs = {"check": True} if how == "check" else {}
    if how == "env":
        monkeypatch.setenv("PORTATTN_DEBUG", "1")
    with pytest.raises(ValueError, match="10 columns, one per key: token-granular req_to_token rows"):
        portattn.paged_attention(**{**inputs, "page_table": token_rows}, backend="torch", **kwargs)
    good = portattn.paged_attention(**inputs, backend="torch", **kwargs)  # the real table passes
    assert max_error(good, paged_attention_ref(**inputs)) < 1e-12


def test_to_page_table_makes_a_page_table_the_ops_check():
    inputs, token_rows, page_size = token_table_case()
    table = to_page_table(token_rows, page_size, seq_lens=inputs["seq_lens_k"], check=True)
    assert isinstance(table, PageTable) and table.page_size == page_size
    assert type(table[:, :2]) is torch.Tensor and table.tolist() == inputs["page_table"].tolist()
    out = portattn.paged_attention(**{**inputs, "page_table": table}, backend="torch", check=True)
    assert max_error(out, paged_attention_ref(**inputs)) < 1e-12
    wrong = to_page_table(token_rows, 2)  # converted for another page size: ids in range, wrong pages
    with pytest.raises(ValueError, match=r"expected a page_table for page size 4 .*made for page size 2"):
        portattn.paged_attention(**{**inputs, "page_table": wrong}, backend="torch")
    wide = PageTable(torch.cat([inputs["page_table"], torch.zeros(2, 20, dtype=I32)], dim=1), page_size)
    portattn.paged_attention(**{**inputs, "page_table": wide}, backend="torch", check=True)  # declared: passes


@pytest.mark.parametrize(
    ("rows", "lens", "message"),
    [
        ([[2, 5, 1], [2, 5, 0]], [10, 7], None),  # a shared prefix, as a prefix cache makes
        ([[2, 5, 1], [2, 6, 5]], [10, 10], "page 5 at page_table.0, 1. and page_table.1, 2."),  # shared, other column
        ([[2, 5, 1], [3, 5, 0]], [10, 7], "page 5 at page_table.0, 1. and page_table.1, 1."),  # prefixes differ
        ([[2, 5, 2], [7, 3, 0]], [10, 7], "page 2 at page_table.0, 0. and page_table.0, 2."),  # twice in a row
    ],
)
def test_check_mode_refuses_pages_shared_outside_a_common_prefix(rows, lens, message):
    inputs, _, _ = token_table_case()
    inputs = dict(inputs, page_table=torch.tensor(rows, dtype=I32), seq_lens_k=torch.tensor(lens, dtype=I32))
    inputs["cu_seqlens_q"] = cu_seqlens([1, 2])
    portattn.paged_attention(**inputs, backend="torch")  # without check: not looked at
    if message is None:
        portattn.paged_attention(**inputs, backend="torch", check=True)
    else:
        with pytest.raises(ValueError, match=message):
            portattn.paged_attention(**inputs, backend="torch", check=True)


def test_mla_decode_checks_page_tables_too():
    kv = torch.randn(64, 4, 48, dtype=torch.float64)
    q_nope, q_rope = torch.randn(2, 4, 32, dtype=torch.float64), torch.randn(2, 4, 16, dtype=torch.float64)
    lens = torch.tensor([10, 7], dtype=I32)
    token_rows = torch.tensor([[8, 9, 10, 11, 20, 21, 22, 23, 4, 5], [28, 29, 30, 31, 12, 13, 14, 0, 0, 0]], dtype=I32)
    portattn.mla_decode(q_nope, q_rope, kv, token_rows, lens, scale=0.1)  # runs: the trap
    with pytest.raises(ValueError, match="token-granular"):
        portattn.mla_decode(q_nope, q_rope, kv, token_rows, lens, scale=0.1, check=True)
    with pytest.raises(ValueError, match="made for page size 2"):
        portattn.mla_decode(q_nope, q_rope, kv, PageTable(token_rows[:, :3].contiguous(), 2), lens, scale=0.1)
