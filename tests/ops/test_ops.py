"""Every backend's paged and varlen attention against the float64 reference.

Fixtures place pages in random order, poison every slot no sequence owns with NaN and point the
unused tail of each page-table row at a NaN page, so an out-of-range read cannot pass.
"""

from __future__ import annotations

import pytest
import torch

import portattn
from conftest import DEVICE, assert_close_to_reference, backend_dtype_params
from portattn import UnsupportedFeatureError
from portattn.backends.registry import backend_class
from portattn.device import is_triton_interpreter
from portattn.testing import (
    cu_seqlens,
    make_paged_case,
    max_error,
    paged_attention_ref,
    tolerance,
    varlen_attention_ref,
)

PAGE_SIZES = [1, 3, 7, 16, 64]
BACKEND_DTYPES = backend_dtype_params("paged_attention")
SLOPES = torch.tensor([0.5, 0.25, 0.0625, 0.0078125], device=DEVICE)  # ALiBi: 2^-1, 2^-2, 2^-4, 2^-7
VARLEN_BACKEND_DTYPES = backend_dtype_params("varlen_attention")


def mixed_batch(page_size: int) -> tuple[list[int], list[int]]:
    """Decodes at lengths 1, P-1, P, P+1; an extend over a prefix of several pages; a full prefill."""
    p = page_size
    k_lens = [1, max(p - 1, 1), p, p + 1, 3 * p + 5, 2 * p + 3]
    q_lens = [1, 1, 1, 1, 6, 2 * p + 3]
    return q_lens, k_lens


def check_paged(case, backend, dtype, **kwargs):
    out = portattn.paged_attention(**case.inputs(), backend=backend, **kwargs)
    ref = paged_attention_ref(**case.inputs(), **kwargs)
    lowp = paged_attention_ref(**case.inputs(), upcast=False, **kwargs)
    assert_close_to_reference(out, ref, lowp, dtype)
    return out


FEATURES = {
    "causal": {},
    "window": {"window_left": 5},
    "window0": {"window_left": 0},
    "chunk": {"attention_chunk_size": 8},
    "softcap": {"logit_softcap": 4.0},
    "non_causal": {"causal": False},
    "scale": {"scale": 0.3},
}


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_paged_features(backend, dtype, feature, page_size):
    q_lens, k_lens = mixed_batch(page_size)
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=dtype, device=DEVICE, seed=page_size)
    check_paged(case, backend, dtype, **FEATURES[feature])


@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_paged_sinks(backend, dtype, page_size):
    q_lens, k_lens = mixed_batch(page_size)
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=dtype, device=DEVICE, seed=3)
    sinks = torch.tensor([-2.0, 0.5, 1.5, 4.0], device=DEVICE).to(dtype)
    check_paged(case, backend, dtype, sinks=sinks)
    check_paged(case, backend, dtype, sinks=sinks, window_left=3, logit_softcap=5.0)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_paged_gqa_ratios(backend, dtype, num_q_heads, num_kv_heads):
    q_lens, k_lens = mixed_batch(3)
    case = make_paged_case(
        q_lens, k_lens, page_size=3, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=dtype, device=DEVICE
    )
    check_paged(case, backend, dtype, window_left=4)


# The peers' suites' head dims besides (vLLM 120, FlashAttention 40, SigLIP's 72); the GPU also runs the rest.
HEAD_DIM_PAIRS = [(64, 64), (80, 80), (128, 128), (64, 32), (80, 128), (40, 40), (72, 72), (224, 224), (120, 120)]
if not is_triton_interpreter():
    HEAD_DIM_PAIRS += [(8, 8), (24, 24), (104, 104), (200, 200), (248, 248), (256, 256)]


@pytest.mark.parametrize(("head_dim", "value_dim"), HEAD_DIM_PAIRS)
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_paged_head_dims(backend, dtype, head_dim, value_dim):
    caps = backend_class(backend).capabilities
    if not (caps.supports("head_dim", head_dim) and caps.supports("head_dim", value_dim)):
        pytest.skip(f"{backend} does not declare head dim {head_dim} / {value_dim}")
    q_lens, k_lens = mixed_batch(16)
    case = make_paged_case(
        q_lens, k_lens, page_size=16, head_dim=head_dim, value_dim=value_dim, dtype=dtype, device=DEVICE, seed=head_dim
    )
    check_paged(case, backend, dtype)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_paged_non_causal_local_windows(backend, dtype, page_size):
    # window_right: keys up to p + R, clipped by the last key; 0 is the causal mask. Decodes see
    # only the left part of their window; the extend's early queries see keys past themselves.
    case = make_paged_case([1, 1, 7, 12], [1, 9, 20, 12], page_size=page_size, dtype=dtype, device=DEVICE, seed=9)
    for left, right in ((-1, 3), (4, 1), (0, 0)):
        check_paged(case, backend, dtype, causal=False, window_left=left, window_right=right)
    causal = portattn.paged_attention(**case.inputs(), backend=backend)
    assert torch.equal(causal, portattn.paged_attention(**case.inputs(), backend=backend, causal=False, window_right=0))


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"window_left": 4, "logit_softcap": 3.0},
        {"attention_chunk_size": 8, "sinks": True},
        {"causal": False, "window_left": 5, "window_right": 3},
    ],
    ids=["plain", "window_softcap", "chunk_sinks", "non_causal_window"],
)
def test_paged_alibi_with_masks(backend, dtype, kwargs):
    page_size = 1 + len(kwargs) * 5  # 1, 11, 11, 16
    q_lens, k_lens = mixed_batch(page_size)
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=dtype, device=DEVICE, seed=13)
    kwargs = dict(kwargs)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.tensor([-2.0, 0.5, 1.5, 4.0], device=DEVICE).to(dtype)
    check_paged(case, backend, dtype, alibi_slopes=SLOPES, **kwargs)


def test_alibi_is_the_distance_bias():
    # Larger slopes attend more locally: with slope s, key p - d weighs e^(-s d) more than a bias-free key.
    case = make_paged_case([1], [6], page_size=4, dtype=torch.float64, seed=1)
    steep = torch.tensor([40.0, 40.0, 40.0, 40.0], dtype=torch.float64)
    out = portattn.paged_attention(**case.inputs(), alibi_slopes=steep, backend="torch")
    v_last = case.v_cache[case.page_table[0, 1], 1].repeat_interleave(2, dim=0)  # key 5: [Hq, D]
    assert max_error(out[0], v_last) <= 1e-12  # every other key is e^-40 behind


def test_window_right_and_alibi_inputs_are_checked():
    case = make_paged_case([1], [5], page_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="expected window_right -1 or 0 with causal=True"):
        portattn.paged_attention(**case.inputs(), window_right=3)
    with pytest.raises(ValueError, match="expected window_right to be an int >= -1"):
        portattn.paged_attention(**case.inputs(), causal=False, window_right=-2)
    with pytest.raises(ValueError, match=r"expected alibi_slopes of shape \[4\] \(one per query head\)"):
        portattn.paged_attention(**case.inputs(), alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="expected alibi_slopes with 1 dims"):
        portattn.paged_attention(**case.inputs(), alibi_slopes=torch.ones(1, 4))


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
@pytest.mark.parametrize(("chunk", "page_size"), [(8, 1), (8, 4), (16, 16)])
def test_decodes_that_cross_a_chunk_boundary(backend, dtype, chunk, page_size):
    # Positions chunk-2 .. chunk+1: the last two decodes start a new chunk and see almost nothing.
    k_lens = [chunk - 1, chunk, chunk + 1, chunk + 2, 3 * chunk]
    case = make_paged_case([1] * len(k_lens), k_lens, page_size=page_size, dtype=dtype, device=DEVICE, seed=chunk)
    check_paged(case, backend, dtype, attention_chunk_size=chunk)
    # An extend whose queries straddle the boundary, and a prompt shorter than one chunk.
    case = make_paged_case([5, 3], [chunk + 2, 3], page_size=page_size, dtype=dtype, device=DEVICE, seed=1)
    check_paged(case, backend, dtype, attention_chunk_size=chunk)


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_decodes_that_cross_a_window_boundary(backend, dtype):
    window = 6
    k_lens = [window, window + 1, window + 2, 4 * window]
    case = make_paged_case([1] * len(k_lens), k_lens, page_size=4, dtype=dtype, device=DEVICE, seed=5)
    check_paged(case, backend, dtype, window_left=window)


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_extend_over_a_long_prefix(backend, dtype):
    case = make_paged_case([7, 1, 33], [300, 257, 33 + 190], page_size=16, dtype=dtype, device=DEVICE, seed=11)
    check_paged(case, backend, dtype)
    check_paged(case, backend, dtype, window_left=40)


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_out_buffer_is_filled_and_returned(backend, dtype):
    case = make_paged_case([1, 4], [9, 4], page_size=3, dtype=dtype, device=DEVICE)
    out = torch.full((5, 4, 64), float("nan"), dtype=dtype, device=DEVICE)
    got = portattn.paged_attention(**case.inputs(), backend=backend, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = paged_attention_ref(**case.inputs())
    assert max_error(out, ref) <= tolerance(ref, paged_attention_ref(**case.inputs(), upcast=False), dtype)


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_page_table_is_page_granular(backend, dtype):
    # Passing the token-granular req_to_token rows instead of the page table must not pass quietly:
    # the ids then point at the wrong pages (here: out of range, which validation reports).
    case = make_paged_case([1], [10], page_size=4, dtype=dtype, device=DEVICE, spare_pages=0, extra_columns=0)
    row = case.page_table[0]
    token_rows = (row.repeat_interleave(4) * 4 + torch.arange(4, device=DEVICE).repeat(row.shape[0]))[None, :10]
    assert torch.equal(portattn.to_page_table(token_rows.int(), 4), case.page_table)
    with pytest.raises(ValueError, match="expected page ids in"):
        portattn.paged_attention(
            case.q, case.k_cache, case.v_cache, token_rows.int(), case.cu_seqlens_q, case.seq_lens_k, backend=backend
        )


def _varlen_inputs(q_lens, k_lens, *, heads=(4, 2), head_dim=64, value_dim=None, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    value_dim = value_dim or head_dim
    q = torch.randn(sum(q_lens), heads[0], head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(sum(k_lens), heads[1], head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(sum(k_lens), heads[1], value_dim, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, cu_seqlens(q_lens, DEVICE), cu_seqlens(k_lens, DEVICE)


def check_varlen(args, backend, dtype, **kwargs):
    try:
        out = portattn.varlen_attention(*args, backend=backend, **kwargs)
    except UnsupportedFeatureError as exc:
        assert backend != "torch", "the reference backend supports every feature"
        assert "'torch'" in str(exc), "the error names the backends that have the feature"
        pytest.skip(f"declared unsupported: {exc}")
    ref = varlen_attention_ref(*args, **kwargs)
    lowp = varlen_attention_ref(*args, upcast=False, **kwargs)
    err, tol = max_error(out, ref), tolerance(ref, lowp, dtype)
    assert err <= tol, f"max error {err:.3e} > tolerance {tol:.3e}"
    return out, ref


VARLEN_FEATURES = {
    "full": {},
    "alibi_window": {"window_size": (6, 2), "alibi_slopes": SLOPES, "logit_softcap": 3.0},
    "causal": {"causal": True},
    "window_8_8": {"window_size": (8, 8)},
    "window_3_0": {"window_size": (3, 0)},
    "causal_window": {"causal": True, "window_size": (5, -1)},
    "sinks_window": {"window_size": (8, 8), "sinks": "sinks"},
    "softcap": {"logit_softcap": 3.0},
}


@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize(("backend", "dtype"), VARLEN_BACKEND_DTYPES)
def test_varlen_features_head_dim_80(backend, dtype, feature):
    lens = [1, 17, 5, 33, 2]  # length 1 and odd lengths
    args = _varlen_inputs(lens, lens, head_dim=80, dtype=dtype, seed=len(feature))
    kwargs = dict(VARLEN_FEATURES[feature])
    if kwargs.get("sinks") == "sinks":
        kwargs["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE).to(dtype)
    check_varlen(args, backend, dtype, **kwargs)


@pytest.mark.parametrize(("backend", "dtype"), VARLEN_BACKEND_DTYPES)
def test_varlen_cross_attention_and_empty_rows(backend, dtype):
    # Fewer keys than queries, causal: the first queries sit at negative positions and see nothing.
    args = _varlen_inputs([6, 3, 0], [2, 9, 4], dtype=dtype, value_dim=32)
    out, _ = check_varlen(args, backend, dtype, causal=True)
    assert torch.count_nonzero(out[:4]) == 0
    check_varlen(args, backend, dtype, max_seqlen_q=6, max_seqlen_k=9)


def test_varlen_defaults_to_self_attention():
    q, k, v, cu, _ = _varlen_inputs([3, 4], [3, 4], dtype=torch.float64)
    assert torch.equal(portattn.varlen_attention(q, k, v, cu), portattn.varlen_attention(q, k, v, cu, cu))


def test_fully_masked_rows_with_sinks_are_zero():
    q, k, v, cu_q, cu_k = _varlen_inputs([4], [1], dtype=torch.float64)
    out = portattn.varlen_attention(
        q, k, v, cu_q, cu_k, causal=True, sinks=torch.ones(4, dtype=torch.float64, device=DEVICE)
    )
    assert torch.count_nonzero(out[:3]) == 0 and torch.count_nonzero(out[3]) > 0


def test_unused_slots_are_never_read():
    # Same keys, different garbage in the unused slots and the junk tail: bit-identical outputs.
    case = make_paged_case([1, 3], [5, 3], page_size=4, dtype=torch.float32)
    a = portattn.paged_attention(**case.inputs(), backend="torch")
    nan_slots = torch.isnan(case.k_cache)
    case.k_cache[nan_slots] = 1e4
    case.v_cache[torch.isnan(case.v_cache)] = -1e4
    b = portattn.paged_attention(**case.inputs(), backend="torch")
    assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("group_tokens", [1, 80, 1 << 12])  # groups of 1, 2 and all 7
def test_torch_decode_batches_in_groups(monkeypatch, group_tokens):
    # The reference backend attends decode batches in padded groups; group edges must not matter.
    from portattn.backends import torch_ref

    monkeypatch.setattr(torch_ref, "DECODE_GROUP_TOKENS", group_tokens)
    k_lens = [1, 6, 7, 8, 30, 2, 15]
    case = make_paged_case([1] * len(k_lens), k_lens, page_size=7, dtype=torch.float32, device=DEVICE, seed=2)
    check_paged(case, "torch", torch.float32, window_left=4)
    check_paged(case, "torch", torch.float32, sinks=torch.tensor([0.0, 1.0, -1.0, 2.0], device=DEVICE))


@pytest.mark.parametrize("q_lens", [[1, 1], [3, 2]])  # decode groups and the per-sequence path
def test_torch_backend_does_not_hide_a_corrupt_visible_key(q_lens):
    # Masking must replace only keys nobody may see: a NaN in a visible key shows in the output.
    case = make_paged_case(q_lens, [5, 4], page_size=2, dtype=torch.float32)
    first_page = int(case.page_table[0, 0])
    case.k_cache[first_page, 1] = float("nan")  # key 1 of sequence 0, seen by every query there
    out = portattn.paged_attention(**case.inputs(), backend="torch")
    assert torch.isnan(out[: q_lens[0]]).all() and torch.isfinite(out[q_lens[0] :]).all()
