"""Per-forward metadata of the attention ops, and the static buffers of captured uniform decode steps.

``plan_paged`` / ``plan_varlen`` return a :class:`PagedMetadata` / :class:`VarlenMetadata` (backends
subclass them with named fields for what their op methods need; ``paged_fields`` and
``varlen_fields`` make the common fields, with one host copy of the lengths);
``portattn.mla.plan_mla_decode`` returns the :class:`MLADecodeMetadata` that ``mla_decode`` reads.
A graph plan is the same metadata viewed on :class:`GraphBuffers`, the memory a captured uniform
step (every sequence the same number of new tokens) replays on (``graph_fields``).
:class:`PagedBatch` is what ``AttentionBackend.plan`` reads from an engine's forward batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .cascade import CascadeMetadata


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
    # The engine's plan of a batch whose sequences share their first pages: layers whose attention a
    # cascade computes exactly attend through it (``AttentionBackend.attend``); None: plain paged.
    cascade: CascadeMetadata | None = None

    @property
    def batch_size(self) -> int:
        return self.seq_lens_k.shape[0]

    @property
    def launch_key(self) -> tuple:
        """What the plan's launches depend on besides the lengths on the device (backends that choose
        split counts or tiles from the plan add them): two graph plans of one shape with equal keys
        replay alike (``engine/graphs.py`` captures a short shape only where its key differs)."""
        return ()


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
    seq_lens_k: torch.Tensor  # [B] int32, one query per row: the keys it sees
    page_size: int
    max_seqlen_k: int  # an upper bound of seq_lens_k (host int)
    num_kv_splits: int
    workspace: torch.Tensor | None  # uint8, at least workspace_bytes; None when num_kv_splits == 1
    workspace_bytes: int
    partials: tuple[torch.Tensor, torch.Tensor] | None = None  # partial_buffers views of the workspace
    # Keys a split holds at least (the kernel's floor): mla_workspace.MIN_SPLIT_TOKENS where the split count was
    # chosen from the problem, so that a captured graph and an eager step cut a sequence alike; 1 where forced.
    min_split_keys: int = 1
    # The split count was chosen from the problem (not given): a kernel that runs faster at fewer splits may use
    # fewer (the workspace holds their partials); a given count is always run as given.
    splits_chosen: bool = False

    @property
    def batch_size(self) -> int:
        return self.seq_lens_k.shape[0]


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


def cu_seqlens_of(lengths: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``[B + 1]`` int32 offsets on ``device`` of sequences of ``lengths`` (host ints): ``0, n0, n0 + n1, ...``."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=cu[1:])
    return cu.to(device)


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
    """Static inputs of captured uniform decode steps, allocated once.

    A **uniform step** is ``B`` sequences that each bring the same number ``q = uniform_q_len`` of new
    tokens, the last ``q`` of their keys (bottom-right aligned): ``q = 1`` for plain decoding,
    ``k + 1`` when speculative decoding verifies ``k`` drafted tokens. Its tokens are sequence-major:
    token ``i`` of sequence ``b`` is row ``b * q + i``.

    A graph replays the kernels it recorded on the memory it recorded them with, so every per-step
    fact a uniform step reads lives here, at a fixed address and at full size: up to
    ``max_batch_size`` sequences of up to ``max_uniform_q_len`` new tokens, page tables
    ``max_pages`` wide (the engine's longest context). :meth:`AttentionBackend.plan_into` writes one
    step into the first rows; :meth:`AttentionBackend.graph_metadata` views the first rows once per
    captured ``(batch_size, uniform_q_len)``. Backends subclass it to add their own static buffers.
    """

    cu_seqlens_q: torch.Tensor  # [max_uniform_q_len, max_batch_size + 1] int32: row q - 1 is 0, q, 2q, ... (constant)
    seq_lens_k: torch.Tensor  # [max_batch_size] int32, the new tokens included
    page_table: torch.Tensor  # [max_batch_size, max_pages] int32, page-granular, full width
    out_cache_loc: torch.Tensor  # [max_batch_size * max_uniform_q_len] int64 slots the new tokens' K/V go to
    page_size: int

    @property
    def max_batch_size(self) -> int:
        return self.seq_lens_k.shape[0]

    @property
    def max_uniform_q_len(self) -> int:
        return self.cu_seqlens_q.shape[0]

    @property
    def max_seqlen_k(self) -> int:
        """The longest context a row can hold (the bound a graph plan gives for its lengths)."""
        return self.page_table.shape[1] * self.page_size

    def check_shape(self, batch_size: int, uniform_q_len: int) -> None:
        """Raise ``ValueError`` unless a uniform step of this shape fits the buffers."""
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"expected batch_size in [1, {self.max_batch_size}], got {batch_size}")
        if not 1 <= uniform_q_len <= self.max_uniform_q_len:
            raise ValueError(f"expected uniform_q_len in [1, {self.max_uniform_q_len}], got {uniform_q_len}")


def graph_buffer_fields(
    max_batch_size: int, max_pages: int, page_size: int, device: torch.device, *, max_uniform_q_len: int = 1
) -> dict:
    """The :class:`GraphBuffers` fields, for ``init_graph_buffers`` overrides. Every row starts as a
    sequence of ``max_uniform_q_len`` keys in page 0 (valid, so that a warm-up replay before any
    ``plan_into`` reads nothing out of range)."""
    if not isinstance(max_uniform_q_len, int) or max_uniform_q_len < 1:
        raise ValueError(f"expected max_uniform_q_len to be a positive int, got {max_uniform_q_len!r}")
    q_lens = torch.arange(1, max_uniform_q_len + 1, dtype=torch.int32, device=device)  # [Q]
    sequences = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)  # [B + 1]
    return dict(
        cu_seqlens_q=q_lens[:, None] * sequences,  # [Q, B + 1]
        seq_lens_k=torch.full((max_batch_size,), max_uniform_q_len, dtype=torch.int32, device=device),
        page_table=torch.zeros((max_batch_size, max_pages), dtype=torch.int32, device=device),
        out_cache_loc=torch.zeros(max_batch_size * max_uniform_q_len, dtype=torch.int64, device=device),
        page_size=page_size,
    )


def graph_fields(
    buffers: GraphBuffers, batch_size: int, uniform_q_len: int = 1, max_seqlen_k: int | None = None
) -> dict:
    """The :class:`PagedMetadata` fields of a graph plan of ``batch_size`` sequences of ``uniform_q_len``
    new tokens: views of the first rows of ``buffers``; no host copy of the lengths (they change
    between replays). ``max_seqlen_k``: the most keys a row of a step replaying the plan holds (the
    buffers' width when None)."""
    buffers.check_shape(batch_size, uniform_q_len)
    if max_seqlen_k is None:
        max_seqlen_k = buffers.max_seqlen_k
    elif not uniform_q_len <= max_seqlen_k <= buffers.max_seqlen_k:
        raise ValueError(f"expected max_seqlen_k in [{uniform_q_len}, {buffers.max_seqlen_k}], got {max_seqlen_k}")
    return dict(
        cu_seqlens_q=buffers.cu_seqlens_q[uniform_q_len - 1, : batch_size + 1],
        seq_lens_k=buffers.seq_lens_k[:batch_size],
        page_table=buffers.page_table[:batch_size],
        page_size=buffers.page_size,
        max_seqlen_q=uniform_q_len,
        max_seqlen_k=max_seqlen_k,
        q_lens=None,
        k_lens=None,
        out_cache_loc=buffers.out_cache_loc[: batch_size * uniform_q_len],
    )
