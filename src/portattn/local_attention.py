"""Chunked local attention (Llama 4) as a batch of "virtual" sequences.

With ``attention_chunk_size = C`` a query at absolute position ``p`` sees key ``j`` iff ``j <= p``
and ``j // C == p // C``. Chunk boundaries are absolute positions, fixed by ``C`` alone: they never
depend on what else is in the batch (clamping ``C`` to the longest sequence of the batch would
split a short prompt across two chunks).

Each (sequence, chunk) pair that holds queries becomes one virtual sequence whose keys start at the
chunk's first position. Plain causal attention over the virtual batch then equals chunked attention
over the real one, so a backend without native chunk support can still serve chunked layers.

Worked example: ``C = 4``, ``page_size = 2``, three sequences with query lengths ``[4, 10, 5]`` and
key lengths ``[6, 17, 9]``. The first holds queries at positions 2..5: positions 2, 3 fall in chunk
``[0, 4)`` (2 queries over keys 0..3) and 4, 5 in chunk ``[4, 8)`` (2 queries over keys 4..5)::

    virtual q lens [2, 2, 1, 4, 4, 1, 4, 1]     cu [0, 2, 4, 5, 9, 13, 14, 18, 19]
    virtual k lens [4, 2, 4, 4, 4, 1, 4, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import is_int


@dataclass(frozen=True, eq=False)
class LocalAttentionBatches:
    """Virtual batches for chunked attention; query tokens keep their order and storage.

    Attributes:
        cu_seqlens_q: ``[V + 1]`` int32 offsets of each virtual sequence's queries in ``q``.
        seq_lens_k: ``[V]`` int32 keys per virtual sequence (they start at the chunk start).
        page_table: ``[V, C // page_size]`` int32, page-granular: column ``p`` is the physical
            page of the chunk's ``p``-th page.
        batch_index: ``[V]`` int64 index of the real sequence each virtual one came from.
        max_seqlen_q / max_seqlen_k: Python ints, so launches need no host sync.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    page_table: torch.Tensor
    batch_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_virtual(self) -> int:
        return self.seq_lens_k.shape[0]


def make_local_attention_virtual_batches(
    attention_chunk_size: int,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
) -> LocalAttentionBatches:
    """Split each sequence into one virtual sequence per attention chunk that holds queries.

    Args:
        attention_chunk_size: ``C``, a positive multiple of ``page_size`` (chunks must start on
            page boundaries so that each virtual sequence's keys start a page).
        cu_seqlens_q: ``[B + 1]`` int32 query offsets.
        seq_lens_k: ``[B]`` int32 key lengths (including the new tokens); queries are
            bottom-right aligned, so query ``i`` of ``n`` sits at position ``L - n + i``.
        page_table: ``[B, max_pages]`` int32, **page-granular** (see :mod:`portattn.paging`;
            convert ``req_to_token`` rows with :func:`portattn.to_page_table` first).
        page_size: tokens per page.

    Returns:
        :class:`LocalAttentionBatches`. Computed with vectorized tensor ops on the inputs' device;
        one host sync reads the virtual batch count and the max lengths.
    """
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"expected page_size to be a positive int, got {page_size!r}")
    if not is_int(attention_chunk_size) or attention_chunk_size < 1:
        raise ValueError(f"expected attention_chunk_size to be a positive int, got {attention_chunk_size!r}")
    if attention_chunk_size % page_size != 0:
        raise ValueError(
            f"expected attention_chunk_size to be a multiple of page_size {page_size}, got {attention_chunk_size}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != seq_lens_k.shape[0]:
        raise ValueError(
            f"expected page_table of shape [{seq_lens_k.shape[0]}, max_pages], got {tuple(page_table.shape)}"
        )
    chunk = attention_chunk_size
    device = seq_lens_k.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [B]
    k_lens = seq_lens_k.long()  # [B]
    first_pos = k_lens - q_lens  # position of each sequence's first query
    first_chunk = torch.div(first_pos, chunk, rounding_mode="floor")
    last_chunk = torch.div(k_lens - 1, chunk, rounding_mode="floor")
    counts = torch.where(q_lens > 0, last_chunk - first_chunk + 1, 0)  # [B]

    batch_index = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)  # [V]
    starts = torch.cumsum(counts, 0) - counts  # first virtual index of each sequence
    nth = torch.arange(batch_index.shape[0], device=device) - starts[batch_index]  # chunk ordinal
    chunk_start = (first_chunk[batch_index] + nth) * chunk  # absolute position of key 0
    chunk_end = torch.minimum(chunk_start + chunk, k_lens[batch_index])
    q_start = torch.maximum(chunk_start, first_pos[batch_index])
    local_q = chunk_end - q_start  # [V]
    local_k = chunk_end - chunk_start  # [V]

    pages_per_chunk = chunk // page_size
    cols = torch.div(chunk_start, page_size, rounding_mode="floor")[:, None] + torch.arange(
        pages_per_chunk, device=device
    )  # [V, C / P]
    # Columns past a row's width cover keys past its length and are never read.
    cols = cols.clamp(max=page_table.shape[1] - 1)
    local_table = page_table[batch_index[:, None], cols].to(torch.int32)

    cu = torch.zeros(local_q.shape[0] + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(local_q, 0)
    if local_q.numel():
        max_q, max_k = (int(x) for x in torch.stack([local_q.max(), local_k.max()]).tolist())
    else:
        max_q = max_k = 0
    return LocalAttentionBatches(
        cu_seqlens_q=cu,
        seq_lens_k=local_k.to(torch.int32),
        page_table=local_table,
        batch_index=batch_index,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )
