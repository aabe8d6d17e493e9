"""Virtual batches for chunked local attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import portattn
from portattn import make_local_attention_virtual_batches
from portattn.testing import cu_seqlens, make_paged_case, max_error


def test_worked_example():
    out = make_local_attention_virtual_batches(
        4,
        torch.tensor([0, 4, 14, 19], dtype=torch.int32),
        torch.tensor([6, 17, 9], dtype=torch.int32),
        torch.arange(30, dtype=torch.int32).view(3, 10),
        2,
    )
    assert out.cu_seqlens_q.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    assert (out.cu_seqlens_q[1:] - out.cu_seqlens_q[:-1]).tolist() == [2, 2, 1, 4, 4, 1, 4, 1]
    assert out.seq_lens_k.tolist() == [4, 2, 4, 4, 4, 1, 4, 1]
    assert out.page_table.tolist() == [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]
    assert out.batch_index.tolist() == [0, 0, 1, 1, 1, 1, 2, 2]
    assert (out.max_seqlen_q, out.max_seqlen_k) == (4, 4)
    assert out.cu_seqlens_q.dtype == out.seq_lens_k.dtype == out.page_table.dtype == torch.int32


def test_short_prompt_is_one_chunk_whatever_the_batch_holds():
    # chunk 16, page 4: a 10-token prompt is one chunk. Clamping the chunk to the batch's longest
    # sequence floored to a page multiple (8) would split it into [0, 8) and [8, 10).
    out = make_local_attention_virtual_batches(
        16, cu_seqlens([10]), torch.tensor([10], dtype=torch.int32), torch.tensor([[5, 2, 9, 0]], dtype=torch.int32), 4
    )
    assert out.seq_lens_k.tolist() == [10] and out.cu_seqlens_q.tolist() == [0, 10]
    assert out.page_table.tolist() == [[5, 2, 9, 0]]


def test_decode_at_a_chunk_boundary_starts_a_new_chunk():
    # Decodes at positions 15 and 16 with chunk 16: the first sees 16 keys, the second only itself.
    out = make_local_attention_virtual_batches(
        16,
        cu_seqlens([1, 1]),
        torch.tensor([16, 17], dtype=torch.int32),
        torch.arange(10, dtype=torch.int32).view(2, 5),
        4,
    )
    assert out.seq_lens_k.tolist() == [16, 1]
    assert out.page_table.tolist() == [[0, 1, 2, 3], [9, 9, 9, 9]]  # columns past the row are clamped, never read


def test_sequences_without_queries_produce_no_virtual_batch():
    out = make_local_attention_virtual_batches(
        4, cu_seqlens([0, 3]), torch.tensor([9, 3], dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32), 1
    )
    assert out.batch_index.tolist() == [1] and out.seq_lens_k.tolist() == [3]


def test_empty_batch():
    out = make_local_attention_virtual_batches(
        4, cu_seqlens([]), torch.zeros(0, dtype=torch.int32), torch.zeros(0, 3, dtype=torch.int32), 2
    )
    assert out.num_virtual == 0 and out.cu_seqlens_q.tolist() == [0] and out.max_seqlen_k == 0


@pytest.mark.parametrize(
    ("chunk", "page_size", "message"),
    [
        (6, 4, "expected attention_chunk_size to be a multiple of page_size 4, got 6"),
        (0, 1, "positive int"),
        (4, 0, "page_size to be a positive int"),
    ],
)
def test_rejects_bad_chunk(chunk, page_size, message):
    with pytest.raises(ValueError, match=message):
        make_local_attention_virtual_batches(
            chunk,
            cu_seqlens([1]),
            torch.tensor([4], dtype=torch.int32),
            torch.zeros(1, 4, dtype=torch.int32),
            page_size,
        )


def test_rejects_token_table_shape_mismatch():
    with pytest.raises(ValueError, match=r"page_table of shape \[2, max_pages\]"):
        make_local_attention_virtual_batches(
            4, cu_seqlens([1, 1]), torch.tensor([4, 4], dtype=torch.int32), torch.zeros(3, 4, dtype=torch.int32), 2
        )


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 3, 4]),
    chunk_pages=st.integers(1, 4),
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_chunked_attention_equals_attention_over_virtual_batches(page_size, chunk_pages, seqs, seed):
    chunk = chunk_pages * page_size
    k_lens = [max(prefix + n, 1) for prefix, n in seqs]
    q_lens = [min(n, L) for (_, n), L in zip(seqs, k_lens)]
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=torch.float64, seed=seed)

    direct = portattn.paged_attention(**case.inputs(), attention_chunk_size=chunk, backend="torch")
    vb = make_local_attention_virtual_batches(chunk, case.cu_seqlens_q, case.seq_lens_k, case.page_table, page_size)
    virtual = portattn.paged_attention(
        case.q, case.k_cache, case.v_cache, vb.page_table, vb.cu_seqlens_q, vb.seq_lens_k, backend="torch"
    )
    assert max_error(virtual, direct) < 1e-12
