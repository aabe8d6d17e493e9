"""Triton-specific cases: split-KV, long decodes, page and head-dim edges, poisoning, no host sync.

Under ``TRITON_INTERPRET=1`` (CI, no GPU) shapes stay tiny and dtypes are fp32/fp16; on a GPU the
same tests also run bf16 and the wide head dims.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import portattn
from conftest import DEVICE
from portattn import UnsupportedFeatureError
from portattn.backends.base import AttentionParams
from portattn.backends.registry import available_backends
from portattn.device import is_triton_interpreter
from portattn.testing import (
    cu_seqlens,
    lse_error,
    lse_tolerance,
    make_paged_case,
    max_error,
    paged_attention_ref,
    tolerance,
    varlen_attention_ref,
)

pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="triton does not run here")

if "triton" in available_backends(DEVICE):
    from portattn.backends.triton import TritonBackend
    from portattn.kernels.triton.launch import (
        TileConfig,
        attention_forward,
        choose_num_kv_splits,
        choose_tiles,
        column_tiles,
        dot_precision,
        next_pow2,
        row_alignment,
    )

INTERPRETED = is_triton_interpreter()
DTYPES = [torch.float32, torch.float16] if INTERPRETED else [torch.float16, torch.bfloat16]
# Any head dim up to 256: one, two or three column tiles, and dims that are not multiples of 16.
HEAD_DIMS = [32, 40, 72, 112, 160, 224] if INTERPRETED else [*range(8, 257, 8), 59, 111]


def reference(case, **kwargs):
    ref = paged_attention_ref(**case.inputs(), **kwargs)
    lowp = paged_attention_ref(**case.inputs(), upcast=False, **kwargs)
    return ref, tolerance(ref, lowp, case.q.dtype)


def run_planned(case, num_kv_splits=None, return_lse=False, **kwargs):
    """Plan once, then call the backend's per-layer method (the engine's path); NaN-filled outputs."""
    backend = TritonBackend()
    metadata = backend.plan_paged(
        case.cu_seqlens_q,
        case.seq_lens_k,
        case.page_table,
        case.k_cache.shape[1],
        num_heads=case.q.shape[1],
        num_kv_splits=num_kv_splits,
    )
    params = AttentionParams(scale=case.q.shape[-1] ** -0.5, **kwargs)
    out = torch.full((*case.q.shape[:2], case.v_cache.shape[-1]), float("nan"), dtype=case.q.dtype, device=DEVICE)
    if not return_lse:
        return backend.paged_attention(case.q, case.k_cache, case.v_cache, metadata, params, out)
    lse = torch.full(case.q.shape[:2], float("nan"), device=DEVICE)
    return backend.paged_attention(case.q, case.k_cache, case.v_cache, metadata, params, out, lse=lse), lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"window_left": 40, "alibi": True}, {"attention_chunk_size": 64, "sinks": True}],
    ids=["causal", "window_alibi", "chunk_sinks"],
)
def test_forced_split_counts_agree_with_each_other_and_the_reference(dtype, kwargs):
    # Decodes and a short extend; a window and a chunk leave some splits without any key.
    case = make_paged_case([1, 1, 3, 1], [150, 7, 97, 1], page_size=7, dtype=dtype, device=DEVICE, seed=3)
    kwargs = dict(kwargs)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.linspace(-1.0, 3.0, case.q.shape[1], device=DEVICE)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.0625, 0.0078125], device=DEVICE)
    ref, tol = reference(case, **kwargs)
    _, ref_lse = paged_attention_ref(**case.inputs(), return_lse=True, **kwargs)
    outs = {s: run_planned(case, num_kv_splits=s, return_lse=True, **kwargs) for s in (1, 2, 3, 8)}
    for s, (out, lse) in outs.items():
        assert max_error(out, ref) <= tol, f"{s} splits: {max_error(out, ref):.3e} > {tol:.3e}"
        assert max_error(out, outs[1][0]) <= tol, f"{s} splits differ from 1 split"
        assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, dtype), f"{s} splits: LSE"


def test_long_decode_is_split_and_correct():
    num_keys = 2048 if INTERPRETED else 65536
    batch, heads = 1, 4
    assert choose_num_kv_splits(num_keys, batch, heads, 1) > 1
    case = make_paged_case([1], [num_keys], page_size=16, dtype=torch.float16, device=DEVICE, seed=5)
    ref, tol = reference(case)
    out = portattn.paged_attention(**case.inputs(), backend="triton")
    assert max_error(out, ref) <= tol


def test_split_count_is_a_function_of_the_problem_size():
    assert choose_num_kv_splits(65536, 1, 32, 1) == 32  # one long sequence: spread over key ranges
    assert choose_num_kv_splits(65536, 4, 32, 1) == 8  # about 256 programs of 8 KV heads (H200: fastest)
    assert choose_num_kv_splits(8192, 32, 32, 1) == 1  # bounded by 512 keys per split (the work asks for 1)
    assert choose_num_kv_splits(8192, 4, 32, 1) == 8  # few sequences: 64 keys a range at least
    assert choose_num_kv_splits(8192, 8, 32, 1) == 4
    assert choose_num_kv_splits(1536, 8, 32, 1) == 3  # the work asks for 4 ranges: 512 keys a range
    assert choose_num_kv_splits(65536, 1, 32, 4) == 64  # query runs (verifications) aim at twice the work
    # Decodes over an fp8 cache: at least 2 splits where the keys allow (H200: 1.09x at B=64 over 4096).
    assert choose_num_kv_splits(4096, 64, 32, 1, kv_itemsize=1) == 2
    assert choose_num_kv_splits(4096, 8, 32, 1, kv_itemsize=1) == 4  # as many as a 16-bit cache gets
    assert choose_num_kv_splits(700, 64, 32, 1, kv_itemsize=1) == 1  # under 2 x 512 keys: no split
    assert choose_num_kv_splits(4096, 64, 32, 4, kv_itemsize=1) == 1  # query runs: the 16-bit rule
    assert choose_num_kv_splits(4096, 64, 32, 1) == 1  # enough (sequence, head) pairs already
    assert choose_num_kv_splits(4096, 4, 32, 1) == 8  # few sequences (work for 8 ranges or more): by the work
    assert choose_num_kv_splits(1536, 1, 32, 1, kv_itemsize=2) == 24  # 64 keys a range (the 8B's batch-1 graph)
    assert choose_num_kv_splits(1536, 1, 32, 1, kv_itemsize=1) == 3  # fp8 caches keep 512 keys a range
    assert choose_num_kv_splits(1536, 4, 32, 1, kv_itemsize=4) == 8
    # Short decodes (at most 512 keys, a 16-bit cache): 64-key ranges, as many as the work allows.
    assert choose_num_kv_splits(300, 1, 32, 1) == 5
    assert choose_num_kv_splits(512, 1, 9, 1) == 8
    assert choose_num_kv_splits(162, 8, 32, 1) == 3
    assert choose_num_kv_splits(320, 8, 32, 1) == 1  # the work allows 4 ranges, not 5 short ones: none
    assert choose_num_kv_splits(512, 64, 9, 1) == 1
    assert choose_num_kv_splits(513, 1, 32, 1) == 8  # past the short bound: by the work, 64 keys a range at least
    assert choose_num_kv_splits(513, 8, 32, 1) == 1  # the work asks for 4: 512 keys a range
    assert choose_num_kv_splits(300, 1, 32, 1, kv_itemsize=1) == 1  # fp8: its own rule
    assert choose_num_kv_splits(0, 2, 32, 1) == 1  # sequences without keys yet: one (empty) range
    assert choose_num_kv_splits(300, 1, 32, 4) == 1  # query runs: too short to split
    assert choose_num_kv_splits(65536, 1, 32, 512) == 1  # long query runs use query blocks instead
    assert choose_num_kv_splits(8192, 1, 32, 64) == 8  # a cascade's shared pass: 64 queries over a long prefix
    assert choose_num_kv_splits(8192, 4, 32, 16) == 8  # short extends over long contexts


def test_short_decodes_take_short_tiles_only_where_each_range_is_short():
    from portattn.kernels.triton.launch import choose_tiles, short_splits

    assert short_splits(1, 300, 5, 2) and short_splits(1, 512, 8, 2)
    assert not short_splits(1, 512, 2, 2)  # 256 keys a range
    assert not short_splits(1, 300, 5, 1)  # an fp8 cache
    assert not short_splits(4, 64, 1, 2)  # query runs
    assert not short_splits(1, None, 1, 2)  # the longest sequence not known
    short = choose_tiles(1, 3, 64, 64, interpret=False, short_splits=True)
    assert (short.block_n, short.num_warps, short.num_stages) == (32, 4, 2)
    assert choose_tiles(1, 3, 64, 64, interpret=False).block_n == 64
    long_runs = choose_tiles(512, 4, 128, 128, interpret=False, short_splits=True)  # not a decode's tiles
    assert long_runs == choose_tiles(512, 4, 128, 128, interpret=False)


@pytest.mark.parametrize("page_size", [1, 3, 7, 16, 64])
def test_page_sizes_at_lengths_around_a_page(page_size):
    p = page_size
    k_lens = [1, max(p - 1, 1), p, p + 1, 2 * p + 3]
    q_lens = [1, 1, min(2, p), 1, 2 * p + 3]
    case = make_paged_case(q_lens, k_lens, page_size=p, dtype=torch.float16, device=DEVICE, seed=p)
    ref, tol = reference(case)
    out = run_planned(case)
    assert max_error(out, ref) <= tol


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("dtype", [DTYPES[-1]] if INTERPRETED else [torch.float16, torch.bfloat16, torch.float32])
def test_head_dims_are_padded_with_masks(head_dim, num_kv_splits, dtype):
    case = make_paged_case([1, 9], [21, 30], page_size=5, head_dim=head_dim, dtype=dtype, device=DEVICE, seed=head_dim)
    ref, tol = reference(case)
    assert max_error(run_planned(case, num_kv_splits=num_kv_splits), ref) <= tol


@pytest.mark.parametrize(("head_dim", "value_dim"), [(80, 96), (192, 80), (224, 40), (59, 112)])
def test_tail_columns_of_key_and_value_dims_apart(head_dim, value_dim):
    # 80 and 96 are covered as 64 + 16 and 64 + 32 columns, 192 as 128 + 64, 224 as 128 + 64 + 32,
    # 40 as 32 + 16 (8 masked), 59 as 64 (5 masked), 112 as 64 + 32 + 16.
    case = make_paged_case(
        [1, 6], [40, 13], page_size=3, head_dim=head_dim, value_dim=value_dim, dtype=DTYPES[-1], device=DEVICE
    )
    ref, tol = reference(case, window_left=20)
    for num_kv_splits in (1, 2):
        out = run_planned(case, num_kv_splits=num_kv_splits, window_left=20)
        assert max_error(out, ref) <= tol, f"{num_kv_splits} splits"


def test_column_tiles_pad_less_than_the_next_power_of_two():
    assert column_tiles(128) == (128, 0, 0)
    assert column_tiles(80) == (64, 16, 0)
    assert column_tiles(96) == (64, 32, 0)
    assert column_tiles(192) == (128, 64, 0)
    assert column_tiles(112) == (64, 32, 16)
    assert column_tiles(224) == (128, 64, 32)
    assert column_tiles(72) == (64, 16, 0)  # tiles are at least 16 wide: 8 columns masked
    assert column_tiles(24) == (32, 0, 0)
    assert column_tiles(8) == (16, 0, 0)
    assert column_tiles(240) == (256, 0, 0)  # four tiles would not pay
    for dim in range(1, 257):
        tiles = column_tiles(dim)
        assert (sum(tiles) >= dim and sum(tiles) - dim < 16) or tiles == (next_pow2(dim), 0, 0)
        assert all(t == 0 or (t >= 16 and t & (t - 1) == 0) for t in tiles)


def test_gqa_group_of_three_is_padded():
    case = make_paged_case([1, 12], [19, 12], page_size=4, num_q_heads=6, num_kv_heads=2, device=DEVICE)
    ref, tol = reference(case, window_left=6)
    assert max_error(run_planned(case, window_left=6), ref) <= tol


def test_poisoned_cache_and_output_every_row_written():
    case = make_paged_case([1, 4, 17], [33, 20, 17], page_size=8, dtype=torch.float16, device=DEVICE, seed=11)
    assert torch.isnan(case.k_cache[case.junk_page]).all()
    ref, tol = reference(case, logit_softcap=3.0)
    out = run_planned(case, logit_softcap=3.0)  # starts as NaN: every element must be overwritten
    assert max_error(out, ref) <= tol


def test_out_buffer_is_filled_in_place():
    case = make_paged_case([2, 1], [10, 25], page_size=3, device=DEVICE, seed=2)
    buf = torch.full((3, 4, 64), float("nan"), device=DEVICE)
    got = portattn.paged_attention(**case.inputs(), backend="triton", out=buf)
    ref, tol = reference(case)
    assert got.data_ptr() == buf.data_ptr()
    assert max_error(buf, ref) <= tol


def test_varlen_window_and_sinks_across_tiles():
    lens = [45, 3, 38]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 4, 64, generator=gen).to(DEVICE)
    k = torch.randn(sum(lens), 2, 64, generator=gen).to(DEVICE)
    v = torch.randn(sum(lens), 2, 64, generator=gen).to(DEVICE)
    cu = cu_seqlens(lens, DEVICE)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    kwargs = {"window_size": (17, 5), "sinks": sinks, "logit_softcap": 6.0}
    out = portattn.varlen_attention(q, k, v, cu, backend="triton", **kwargs)
    ref = varlen_attention_ref(q, k, v, cu, **kwargs)
    assert max_error(out, ref) <= tolerance(ref, varlen_attention_ref(q, k, v, cu, upcast=False, **kwargs), q.dtype)


def test_per_layer_methods_do_not_sync(monkeypatch):
    case = make_paged_case([1, 1], [700, 40], page_size=16, dtype=torch.float16, device=DEVICE, seed=4)
    backend = TritonBackend()
    metadata = backend.plan_paged(
        case.cu_seqlens_q, case.seq_lens_k, case.page_table, 16, num_heads=case.q.shape[1]
    )  # fmt: skip
    cu = cu_seqlens([5, 9], DEVICE)
    varlen_metadata = backend.plan_varlen(cu, cu)
    x = torch.randn(14, 4, 64, device=DEVICE, dtype=torch.float16)
    kv = torch.randn(14, 2, 64, device=DEVICE, dtype=torch.float16)

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync in a per-layer method")

    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    params = AttentionParams(scale=0.125, window_left=100)
    out = torch.empty(2, 4, 64, device=DEVICE, dtype=torch.float16)
    backend.paged_attention(case.q, case.k_cache, case.v_cache, metadata, params, out)
    backend.varlen_attention(
        x, kv, kv, varlen_metadata, AttentionParams(scale=0.125, causal=False), torch.empty_like(x)
    )
    monkeypatch.undo()
    ref, tol = reference(case, window_left=100)
    assert max_error(out, ref) <= tol


def test_capabilities_and_selection():
    caps = TritonBackend.capabilities
    assert {"paged_attention", "varlen_attention"} <= caps.ops
    assert {"window", "chunk", "sinks", "softcap", "non_causal", "dv_ne_d"} <= caps.features
    assert TritonBackend.priority > 0  # above the torch reference, so auto picks it on GPUs
    assert TritonBackend.runs_natively(torch.device("cpu")) is False
    assert {"lse", "alibi"} <= caps.features and "merge_attention_states" in caps.ops
    assert set(range(8, 257, 8)) == caps.head_dims  # every multiple of 8 up to 256, 40 and 72 included
    case = make_paged_case([1], [5], page_size=4, head_dim=264, device=DEVICE)
    with pytest.raises(UnsupportedFeatureError, match="head dim 264"):
        portattn.paged_attention(**case.inputs(), backend="triton")
    case = make_paged_case([1], [5], page_size=4, head_dim=64, value_dim=272, device=DEVICE)
    with pytest.raises(UnsupportedFeatureError, match="value head dim 272"):
        portattn.paged_attention(**case.inputs(), backend="triton")


def test_row_alignment_is_the_largest_power_of_two_dividing_every_row_stride():
    q = torch.empty(5, 4, 72)
    assert row_alignment(q) == 8
    assert row_alignment(q, torch.empty(3, 16, 2, 128)) == 8
    assert row_alignment(torch.empty(3, 16, 2, 128)) == 16
    assert row_alignment(torch.empty(7, 4, 40)[:, :, :36]) == 8  # a view: strides 160 and 40
    assert row_alignment(torch.empty(7, 59)) == 1
    assert row_alignment(torch.empty(7, 4, 60)) == 4


@pytest.mark.parametrize("head_dim", [40, 72])
def test_head_dims_with_rows_of_odd_alignment(head_dim):
    # q a slice of a fused qkv tensor whose row holds 3 heads less than a multiple of 8 columns: the
    # launcher's alignment falls to what the strides allow, and the kernel must still be right.
    case = make_paged_case([1, 9], [21, 30], page_size=5, head_dim=head_dim, dtype=DTYPES[-1], device=DEVICE, seed=1)
    wide = torch.randn(case.q.shape[0], case.q.shape[1] * head_dim + 3, dtype=case.q.dtype, device=DEVICE)
    q = wide[:, : case.q.shape[1] * head_dim].view(case.q.shape)
    q.copy_(case.q)
    assert row_alignment(q) == 1
    ref, tol = reference(case)
    assert max_error(run_planned(dataclasses.replace(case, q=q)), ref) <= tol
    # the output a view of odd alignment too: written through an aligned buffer
    wide_out = torch.full((q.shape[0], q.shape[1] * head_dim + 3), float("nan"), dtype=q.dtype, device=DEVICE)
    out = wide_out[:, : q.shape[1] * head_dim].view(q.shape)
    cu, lens = case.cu_seqlens_q, case.seq_lens_k
    args = dict(max_seqlen_q=9, scale=head_dim**-0.5, page_table=case.page_table, num_kv_splits=2)
    assert attention_forward(q, case.k_cache, case.v_cache, out, cu, lens, **args) is out
    assert max_error(out, ref) <= tol and bool(wide_out[:, -3:].isnan().all())


def test_float32_dots_are_ieee_unless_tf32_is_allowed():
    """Float32 holds the peers' 1e-5 (relative to the largest output) by default; TF32 only on request."""
    case = make_paged_case([1, 9], [300, 40], page_size=16, head_dim=128, dtype=torch.float32, device=DEVICE, seed=5)
    ref = paged_attention_ref(**case.inputs())
    bound = 1e-5 * float(ref.abs().max())
    assert max_error(run_planned(case), ref) <= bound
    assert dot_precision(torch.float32) == "ieee" and dot_precision(torch.bfloat16) is None
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert dot_precision(torch.float32) == "tf32"
        if not INTERPRETED:  # the interpreter computes every float32 dot in float32
            assert max_error(run_planned(case), ref) > bound, "TF32 asked for: the dots keep 10 mantissa bits"
    finally:
        torch.set_float32_matmul_precision(before)


def test_launcher_validates_inputs():
    case = make_paged_case([1], [5], page_size=4, device=DEVICE)
    out = torch.empty(1, 4, 64, device=DEVICE)
    args = (case.cu_seqlens_q, case.seq_lens_k)
    with pytest.raises(ValueError, match="expected q with a contiguous last dim"):
        q = case.q.transpose(1, 2).contiguous().transpose(1, 2)
        attention_forward(
            q, case.k_cache, case.v_cache, out, *args, max_seqlen_q=1, scale=0.1, page_table=case.page_table
        )
    with pytest.raises(ValueError, match="expected page_table of dtype int32"):
        attention_forward(
            case.q, case.k_cache, case.v_cache, out, *args, max_seqlen_q=1, scale=0.1, page_table=case.page_table.long()
        )
    with pytest.raises(ValueError, match="expected exactly one of page_table and kv_start"):
        attention_forward(case.q, case.k_cache, case.v_cache, out, *args, max_seqlen_q=1, scale=0.1)
    with pytest.raises(ValueError, match="expected block_n to be a power of two"):
        TileConfig(block_q=1, block_m=16, block_n=48)


def test_decode_tiles_pack_query_heads():
    tiles = choose_tiles(1, 4, 128, 128, interpret=False)
    assert (tiles.block_q, tiles.block_m, tiles.block_n) == (4, 16, 64)  # 4 query heads x 4 tokens
    tiles = choose_tiles(4096, 4, 128, 128, interpret=False)
    assert (tiles.block_q, tiles.block_m, tiles.block_n) == (32, 128, 128)
    assert tiles.whole_pages and tiles.pages_ahead  # long query runs: one page id a page (decodes: not)
    assert not any(choose_tiles(1, 4, 128, 128, interpret=False, kv_itemsize=kv).whole_pages for kv in (1, 2))
    assert not choose_tiles(6, 4, 128, 128, interpret=False).whole_pages  # short runs (24 rows): 64-key tiles
    tiles = choose_tiles(4096, 1, 80, 80, interpret=False)  # 64 + 16 columns: narrower tiles
    assert (tiles.block_q, tiles.block_m, tiles.block_n) == (64, 64, 64)
    tiles = choose_tiles(4096, 4, 256, 256, interpret=False)
    assert (tiles.block_m, tiles.block_n) == (64, 32)
    tiles = choose_tiles(1, 4, 128, 128, interpret=False, kv_itemsize=1)  # an fp8 cache: twice the keys per tile
    assert (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages) == (16, 128, 4, 2)
    assert tiles.pages_ahead  # each tile's page ids loaded a tile ahead
    assert not choose_tiles(1, 4, 128, 128, interpret=False).pages_ahead  # 16-bit caches: not


def test_mla_prefill_shape_head_dim_192_value_dim_128():
    # DeepSeek's expanded prefill: K = [k_nope 128 | k_pe 64], V 128 wide, causal varlen.
    from portattn.testing import cu_seqlens, varlen_attention_ref

    gen = torch.Generator().manual_seed(1)
    lens = [5, 17]
    q, k = (torch.randn(sum(lens), 4, 192, generator=gen).to(DTYPES[-1]).to(DEVICE) for _ in range(2))
    v = torch.randn(sum(lens), 4, 128, generator=gen).to(DTYPES[-1]).to(DEVICE)
    cu = cu_seqlens(lens, DEVICE)
    out = portattn.varlen_attention(q, k, v, cu, causal=True, backend="triton")
    ref = varlen_attention_ref(q, k, v, cu, causal=True)
    lowp = varlen_attention_ref(q, k, v, cu, causal=True, upcast=False)
    assert max_error(out, ref) <= tolerance(ref, lowp, DTYPES[-1])


def test_host_power_of_two_equals_tritons():
    import triton

    assert [next_pow2(n) for n in range(1, 1100)] == [triton.next_power_of_2(n) for n in range(1, 1100)]


def test_plans_split_decodes_over_an_fp8_cache_by_its_dtype():
    """The split count of a plan and of a graph's plan follows the cache's dtype."""
    backend = TritonBackend()
    batch, keys, page = 64, 4096, 16
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    lens = torch.full((batch,), keys, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(batch, keys // page + 1, dtype=torch.int32, device=DEVICE)  # room for a shared page
    buffers = backend.init_graph_buffers(batch, keys // page, page, DEVICE, num_heads=32)
    from portattn.cascade import plan_cascade

    for kv_dtype, want in ((torch.bfloat16, 1), (torch.float8_e4m3fn, 2), (None, 1)):
        planned = backend.plan_paged(cu, lens, table, page, num_heads=32, kv_dtype=kv_dtype)
        graph = backend.graph_metadata(buffers, batch, num_heads=32, kv_dtype=kv_dtype)
        # a cascade's own pass: the same decodes over what follows a 16-key shared prefix
        own = plan_cascade(backend, table, cu, lens + 16, page, 16, num_heads=32, kv_dtype=kv_dtype).own
        assert (planned.num_kv_splits, graph.num_kv_splits, own.num_kv_splits) == (want, want, want), kv_dtype


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"window_left": 40, "sinks": True}, {"attention_chunk_size": 64}],
    ids=["causal", "window_sinks", "chunk"],
)
def test_a_mixed_batch_launches_its_decodes_apart(kwargs):
    """The engine's mixed step (decodes first, then prompt chunks and extends) is planned in two parts,
    each launched with its own tiles and split count: outputs and LSEs against the reference, the NaN
    buffers written in every row of both parts."""
    q_lens, k_lens = [1, 1, 1, 1, 9, 3, 1], [300, 7, 8, 150, 9, 40, 16]  # a decode after the prompts stays there
    case = make_paged_case(q_lens, k_lens, page_size=7, dtype=torch.float16, device=DEVICE, seed=11)
    kwargs = dict(kwargs)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.linspace(-1.0, 3.0, case.q.shape[1], device=DEVICE)
    backend = TritonBackend()
    metadata = backend.plan_paged(case.cu_seqlens_q, case.seq_lens_k, case.page_table, 7, num_heads=4,
                                  host_lens=(q_lens, k_lens))  # fmt: skip
    (rows_a, decodes), (rows_b, rest) = metadata.parts
    assert (rows_a, rows_b) == (slice(0, 4), slice(4, None))
    assert decodes.max_seqlen_q == 1 and decodes.k_lens == (300, 7, 8, 150) and decodes.max_seqlen_k == 300
    assert rest.cu_seqlens_q.tolist() == [0, 9, 12, 13] and rest.k_lens == (9, 40, 16)
    assert decodes.num_kv_splits == choose_num_kv_splits(300, 4, 4, 1) > 1  # split as a decode batch
    # every part's device tensors at 16-byte addresses (4 decodes of int32 would be; 1-3 tested below)
    for part in (decodes, rest):
        assert all(t.data_ptr() % 16 == 0 for t in (part.cu_seqlens_q, part.seq_lens_k, part.page_table))
    params = AttentionParams(scale=case.q.shape[-1] ** -0.5, **kwargs)
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), device=DEVICE)
    backend.paged_attention(case.q, case.k_cache, case.v_cache, metadata, params, out, lse=lse)
    ref, tol = reference(case, **kwargs)
    _, ref_lse = paged_attention_ref(**case.inputs(), return_lse=True, **kwargs)
    assert max_error(out, ref) <= tol
    assert lse_error(lse, ref_lse) <= lse_tolerance(ref_lse, torch.float16)


@pytest.mark.parametrize("decodes", [1, 2, 3, 5])
def test_mixed_parts_start_at_aligned_addresses(decodes):
    """After ``decodes`` decodes the rest's lengths and page-table rows are copies where the views would
    start off a 16-byte boundary (each offset would be a kernel variant of its own), equal to them."""
    q_lens, k_lens = [1] * decodes + [9, 3], [30] * decodes + [9, 40]
    case = make_paged_case(q_lens, k_lens, page_size=7, dtype=torch.float16, device=DEVICE, seed=3)
    metadata = TritonBackend().plan_paged(case.cu_seqlens_q, case.seq_lens_k, case.page_table, 7, num_heads=4,
                                          host_lens=(q_lens, k_lens))  # fmt: skip
    (_, first), (_, rest) = metadata.parts
    for part, rows in ((first, slice(0, decodes)), (rest, slice(decodes, None))):
        assert part.seq_lens_k.data_ptr() % 16 == 0 and part.page_table.data_ptr() % 16 == 0
        assert torch.equal(part.seq_lens_k, case.seq_lens_k[rows])
        assert torch.equal(part.page_table, case.page_table[rows])


def test_only_mixed_batches_are_planned_in_parts():
    backend = TritonBackend()
    for q_lens, k_lens in (([1, 1], [5, 9]), ([4, 1], [4, 9]), ([3, 2], [3, 9])):
        case = make_paged_case(q_lens, k_lens, page_size=4, device=DEVICE)
        lens = (q_lens, k_lens)
        assert backend.plan_paged(case.cu_seqlens_q, case.seq_lens_k, case.page_table, 4, host_lens=lens).parts is None
    case = make_paged_case([1, 3], [9, 3], page_size=4, device=DEVICE)
    forced = backend.plan_paged(case.cu_seqlens_q, case.seq_lens_k, case.page_table, 4, num_kv_splits=2,
                                num_heads=4, host_lens=([1, 3], [9, 3]))  # fmt: skip
    assert forced.parts is None  # a forced split count is one launch's
