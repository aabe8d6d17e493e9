"""The plans of KV cache kinds beyond the backend's paged metadata; here the ``"mla"`` kind's.

A kind's pool (:mod:`.kv_cache`) makes them: ``pool.plan(...)`` once per forward in the engine's plan
step (the forward context's ``cache_plan``), and ``pool.graph_plan(...)`` once for captured uniform
steps (a :class:`CacheGraphPlan`).

An ``"mla"`` cache is attended in one of two forms per sequence: **absorbed** for decodes (sequences
of at most ``decode_q_len`` new tokens: :func:`portattn.mla_decode`'s kernel over the latent rows)
and **expanded** for prefill and extend chunks (the latent rows of every key gathered, expanded into
per-head keys and values, and attended with the backend's varlen op). Absorbed decode takes one
query per row, so a decode of ``q > 1`` new tokens (speculative verification) becomes ``q`` rows:
row ``i`` of a sequence of ``L`` keys sees its first ``L - q + 1 + i`` keys, the causal rule of its
own token (:func:`query_rows`). Which sequences take which form, their lengths, split counts,
workspace and key slots depend only on the batch, so they are worked out once here and shared by
every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..backends.base import AttentionBackend
from ..backends.metadata import GraphBuffers, PagedMetadata, VarlenMetadata, cu_seqlens_of
from ..backends.registry import require_ops
from ..mla import MLADecodeMetadata, mla_workspace_size, plan_mla_decode


class CacheGraphPlan(Protocol):
    """A KV cache kind's plan of captured uniform steps, over the backend's :class:`GraphBuffers`."""

    def plan(self, batch_size: int, uniform_q_len: int) -> object:
        """The kind's plan of one captured shape (the context's ``cache_plan``), made once before
        capture: views of static buffers only."""
        ...

    def plan_into(self, batch_size: int, uniform_q_len: int) -> None:
        """After the backend's ``plan_into`` wrote a step: the kind's own buffers (device work only)."""
        ...


@dataclass(frozen=True, eq=False)
class LatentAttentionPlan:
    """Per-forward facts shared by every MLA layer.

    Decodes are attended in the absorbed form (``decode``, one row per new token), the others in the
    expanded form (``varlen``, ``key_slots``). In a batch of both kinds, ``decode_rows`` and
    ``expand_rows`` pick each kind's query tokens; otherwise they are None.
    """

    decode: MLADecodeMetadata | None = None
    varlen: VarlenMetadata | None = None  # expanded form: queries and gathered keys per sequence
    key_slots: torch.Tensor | None = None  # [K] int64 slots of every key, sequence after sequence
    decode_rows: torch.Tensor | None = None  # [T_decode] int64 token rows
    expand_rows: torch.Tensor | None = None  # [T_expand] int64 token rows


def query_rows(
    page_table: torch.Tensor, seq_lens_k: torch.Tensor, q_lens: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of an absorbed decode whose sequences bring ``q_lens[b]`` new tokens each: one row per
    new token, sequence-major, with its sequence's page table and the keys its token sees.

    ``page_table [B, max_pages]``, ``seq_lens_k [B]`` (new tokens included), ``q_lens [B]`` int64 on
    the device, ``num_rows = sum(q_lens)`` as a host int -> ``(page_table [R, max_pages] int32,
    row_lens [R] int32)`` with ``row_lens[r] = seq_lens_k[b] - q_lens[b] + 1 + i`` for token ``i`` of
    sequence ``b`` (each row's ``seq_lens_k``). Device work only (no sync).
    """
    ends = torch.cumsum(q_lens, 0)  # [B] row after each sequence's last
    first = seq_lens_k.long() - ends + 1  # [B] the keys of row r are first[b] + r
    rows = torch.arange(num_rows, device=q_lens.device)  # [R]
    row_lens = torch.repeat_interleave(first, q_lens, output_size=num_rows) + rows  # [R]
    return page_table.repeat_interleave(q_lens, dim=0, output_size=num_rows), row_lens.int()


def plan_latent_attention(
    backend: AttentionBackend, meta: PagedMetadata, *, num_heads: int, kv_lora_rank: int, decode_q_len: int = 1
) -> LatentAttentionPlan:
    """Once per forward, from the backend's paged metadata (its host lengths already in it).
    Sequences of ``1 .. decode_q_len`` new tokens are decodes (absorbed), the others expanded."""
    require_ops(backend, ("mla_decode", "varlen_attention"))
    device = meta.seq_lens_k.device
    decodes = [b for b, n in enumerate(meta.q_lens) if 0 < n <= decode_q_len]
    expands = [b for b, n in enumerate(meta.q_lens) if not 0 < n <= decode_q_len]
    mixed = bool(decodes and expands)
    starts = [0]
    for n in meta.q_lens:
        starts.append(starts[-1] + n)
    plan = {}
    if decodes:
        pick = torch.tensor(decodes, device=device)
        page_table = meta.page_table[pick] if mixed else meta.page_table
        seq_lens_k = meta.seq_lens_k[pick] if mixed else meta.seq_lens_k
        q_lens = [meta.q_lens[b] for b in decodes]
        if max(q_lens) > 1:  # one row per new token
            q_lens_dev = torch.tensor(q_lens, device=device)
            page_table, seq_lens_k = query_rows(page_table, seq_lens_k, q_lens_dev, sum(q_lens))
        plan["decode"] = plan_mla_decode(
            page_table,
            seq_lens_k,
            meta.page_size,
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            max_seqlen_k=max(meta.k_lens[b] for b in decodes),
        )
    if expands:
        q_lens = [meta.q_lens[b] for b in expands]
        k_lens = [meta.k_lens[b] for b in expands]
        page_table = meta.page_table[torch.tensor(expands, device=device)] if mixed else meta.page_table
        cu_q, cu_k = cu_seqlens_of(q_lens, device), cu_seqlens_of(k_lens, device)
        total = sum(k_lens)
        seq = torch.repeat_interleave(
            torch.arange(len(expands), device=device), torch.tensor(k_lens, device=device), output_size=total
        )  # [K] sequence of each key
        pos = torch.arange(total, device=device) - cu_k[seq].long()  # [K] position of each key in its sequence
        page_size = meta.page_size
        plan["key_slots"] = page_table[seq, pos // page_size].long() * page_size + pos % page_size  # [K]
        plan["varlen"] = backend.plan_varlen(cu_q, cu_k, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))
    if mixed:
        plan["decode_rows"] = torch.tensor([r for b in decodes for r in range(starts[b], starts[b + 1])], device=device)
        plan["expand_rows"] = torch.tensor([r for b in expands for r in range(starts[b], starts[b + 1])], device=device)
    return LatentAttentionPlan(**plan)


class LatentGraphPlan:
    """The latent-attention plans of captured uniform steps, over the backend's :class:`GraphBuffers`.

    Every captured step is a decode (absorbed). At ``uniform_q_len`` 1 the decode reads the buffers'
    page table and key counts as they are; at ``q > 1`` it reads one row per new token
    (:func:`query_rows`), written by :meth:`plan_into` into a page table and key counts of its own
    (``page_table [max_rows, max_pages]``, ``seq_lens_k [max_rows]``). One split-KV workspace serves every shape.
    """

    def __init__(self, buffers: GraphBuffers, shapes: Sequence[tuple[int, int]], *, num_heads: int, kv_lora_rank: int):
        self.buffers, self.num_heads, self.kv_lora_rank = buffers, num_heads, kv_lora_rank
        device = buffers.seq_lens_k.device
        max_rows = max((b * q for b, q in shapes if q > 1), default=0)
        self.page_table = torch.zeros((max_rows, buffers.page_table.shape[1]), dtype=torch.int32, device=device)
        self.seq_lens_k = torch.ones(max_rows, dtype=torch.int32, device=device)
        batch = buffers.max_batch_size
        self.q_lens = {q: torch.full((batch,), q, device=device) for _, q in shapes if q > 1}  # [B] int64, constant
        size = max(
            mla_workspace_size(buffers.max_seqlen_k, b * q, num_heads, buffers.page_size, kv_lora_rank=kv_lora_rank)
            for b, q in shapes
        )
        self.workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None

    def plan(self, batch_size: int, uniform_q_len: int) -> LatentAttentionPlan:
        """The plan of one captured shape (made once; views of the static buffers)."""
        if uniform_q_len == 1:
            page_table, seq_lens_k = self.buffers.page_table[:batch_size], self.buffers.seq_lens_k[:batch_size]
        else:
            rows = batch_size * uniform_q_len
            page_table, seq_lens_k = self.page_table[:rows], self.seq_lens_k[:rows]
        decode = plan_mla_decode(
            page_table,
            seq_lens_k,
            self.buffers.page_size,
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            max_seqlen_k=self.buffers.max_seqlen_k,
            workspace=self.workspace,
        )
        return LatentAttentionPlan(decode=decode)

    def plan_into(self, batch_size: int, uniform_q_len: int) -> None:
        """After the backend's ``plan_into``: the rows of each new token (device work only)."""
        if uniform_q_len == 1:
            return
        rows = batch_size * uniform_q_len
        page_table, seq_lens_k = query_rows(
            self.buffers.page_table[:batch_size],
            self.buffers.seq_lens_k[:batch_size],
            self.q_lens[uniform_q_len][:batch_size],
            rows,
        )
        self.page_table[:rows].copy_(page_table)
        self.seq_lens_k[:rows].copy_(seq_lens_k)
