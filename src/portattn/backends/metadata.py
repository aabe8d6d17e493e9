"""Per-forward metadata of the attention ops, and the static buffers of captured decode steps.

``plan_paged`` / ``plan_varlen`` return a :class:`PagedMetadata` / :class:`VarlenMetadata` (backends
subclass them with named fields for what their op methods need; ``paged_fields`` and
``varlen_fields`` make the common fields, with one host copy of the lengths);
``portattn.mla.plan_mla_decode`` returns the :class:`MLADecodeMetadata` that ``mla_decode`` reads.
A graph plan is the same metadata viewed on :class:`GraphBuffers`, the memory a captured decode
step replays on (``graph_fields``). :class:`PagedBatch` is what ``AttentionBackend.plan`` reads from
an engine's forward batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, eq=False)
class PagedMetadata:
    """Per-forward facts for paged attention, built once by ``plan_paged`` (backends subclass it to add
    the launch facts their op methods need, as named fields)."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_k: torch.Tensor  # [B] int32
    page_table: torch.Tensor  # [B, max_pages] int32, page-granular
    page_size: int
    max_seqlen_q: int
    max_seqlen_k: int  # an upper bound of seq_lens_k (its maximum, except in a graph plan)
    # Host copies, for backends that loop over sequences; None in a graph plan (graph_metadata),
    # whose lengths change between replays and live on the device only.
    q_lens: tuple[int, ...] | None
    k_lens: tuple[int, ...] | None
    out_cache_loc: torch.Tensor | None = None  # [T] int64 slots of the new tokens (engine path, set by plan)

    @property
    def batch_size(self) -> int:
        return self.seq_lens_k.shape[0]


@dataclass(frozen=True, eq=False)
class VarlenMetadata:
    """Per-forward facts for varlen attention, built once by ``plan_varlen`` (subclassed as for paged)."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.k_lens)


@dataclass(frozen=True, eq=False)
class MLADecodeMetadata:
    """Per-forward facts of MLA decode, built once by ``portattn.mla.plan_mla_decode`` and shared by all layers."""

    page_table: torch.Tensor  # [B, max_pages] int32, page-granular
    seq_lens: torch.Tensor  # [B] int32
    page_size: int
    max_seq_len: int  # an upper bound of seq_lens (host int)
    num_kv_splits: int
    workspace: torch.Tensor | None  # uint8, at least workspace_bytes; None when num_kv_splits == 1
    workspace_bytes: int
    partials: tuple[torch.Tensor, torch.Tensor] | None = None  # partial_buffers views of the workspace

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


def paged_fields(
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    *,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> dict:
    """The :class:`PagedMetadata` fields (one host copy of the lengths), for ``plan_paged`` overrides.

    ``host_lens = (q_lens, k_lens)``: the lengths as the caller already has them on the host (an
    engine built the batch from them); they must equal the tensors'. Without them the tensors are
    read back (a host sync).
    """
    if host_lens is None:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        k_lens = seq_lens_k.tolist()
    else:
        q_lens, k_lens = host_lens
    return dict(
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=seq_lens_k,
        page_table=page_table,
        page_size=page_size,
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(k_lens, default=0),
        q_lens=tuple(q_lens),
        k_lens=tuple(k_lens),
    )


def varlen_fields(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None, max_seqlen_k: int | None
) -> dict:
    """The :class:`VarlenMetadata` fields (one host copy of the offsets), for ``plan_varlen`` overrides."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    return dict(
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max(q_lens, default=0) if max_seqlen_q is None else max_seqlen_q,
        max_seqlen_k=max(k_lens, default=0) if max_seqlen_k is None else max_seqlen_k,
        q_lens=tuple(q_lens),
        k_lens=tuple(k_lens),
    )


class PagedBatch(Protocol):
    """What ``AttentionBackend.plan`` reads from an engine's forward batch (``portattn.engine.ForwardBatch``).

    ``req_to_token`` is token-granular (``[max_reqs, max_context]`` int32, a multiple of
    ``page_size`` wide); ``req_pool_indices [B]`` pick the batch's rows; ``out_cache_loc [T]`` are
    the slots the new tokens' K/V go to; ``max_seqlen_k`` is a host int. A batch may also carry
    ``q_lens`` and ``k_lens`` (tuples of host ints), which spare the plan reading the lengths back.
    """

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    out_cache_loc: torch.Tensor
    page_size: int
    max_seqlen_k: int
    attention_chunk_size: int | None


@dataclass(frozen=True, eq=False)
class GraphBuffers:
    """Static inputs of captured decode steps (one new token per sequence), allocated once.

    A graph replays the kernels it recorded on the memory it recorded them with, so every per-step
    fact a decode step reads lives here, at a fixed address and at full size: up to
    ``max_batch_size`` sequences, page tables ``max_pages`` wide (the engine's longest context).
    :meth:`AttentionBackend.plan_into` writes one step into the first rows;
    :meth:`AttentionBackend.graph_metadata` views the first ``batch_size`` rows once per captured
    batch size. Backends subclass it to add their own static buffers.
    """

    cu_seqlens_q: torch.Tensor  # [max_batch_size + 1] int32: 0, 1, 2, ... (one query per sequence; constant)
    seq_lens_k: torch.Tensor  # [max_batch_size] int32, the new token included
    page_table: torch.Tensor  # [max_batch_size, max_pages] int32, page-granular, full width
    out_cache_loc: torch.Tensor  # [max_batch_size] int64 slots the new tokens' K/V go to
    page_size: int

    @property
    def max_batch_size(self) -> int:
        return self.seq_lens_k.shape[0]

    @property
    def max_seqlen_k(self) -> int:
        """The longest context a row can hold (the bound a graph plan gives for its lengths)."""
        return self.page_table.shape[1] * self.page_size


def graph_buffer_fields(max_batch_size: int, max_pages: int, page_size: int, device: torch.device) -> dict:
    """The :class:`GraphBuffers` fields, for ``init_graph_buffers`` overrides. Every row starts as a
    one-key sequence in page 0 (valid, so that a warm-up replay before any ``plan_into`` reads
    nothing out of range)."""
    return dict(
        cu_seqlens_q=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
        seq_lens_k=torch.ones(max_batch_size, dtype=torch.int32, device=device),
        page_table=torch.zeros((max_batch_size, max_pages), dtype=torch.int32, device=device),
        out_cache_loc=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
        page_size=page_size,
    )


def graph_fields(buffers: GraphBuffers, batch_size: int) -> dict:
    """The :class:`PagedMetadata` fields of a graph plan of ``batch_size`` decodes: views of the first
    rows of ``buffers``; no host copy of the lengths (they change between replays)."""
    if not 1 <= batch_size <= buffers.max_batch_size:
        raise ValueError(f"expected batch_size in [1, {buffers.max_batch_size}], got {batch_size}")
    return dict(
        cu_seqlens_q=buffers.cu_seqlens_q[: batch_size + 1],
        seq_lens_k=buffers.seq_lens_k[:batch_size],
        page_table=buffers.page_table[:batch_size],
        page_size=buffers.page_size,
        max_seqlen_q=1,
        max_seqlen_k=buffers.max_seqlen_k,
        q_lens=None,
        k_lens=None,
        out_cache_loc=buffers.out_cache_loc[:batch_size],
    )
