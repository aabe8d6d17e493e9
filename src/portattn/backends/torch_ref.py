"""The PyTorch reference backend: every feature, any device, any page size.

This is the executable specification of portattn's semantics. It gathers keys page by page and
attends with batched matmuls (no loop over tokens or pages): one sequence at a time for prefill
and extend, groups of padded sequences for decode batches. The softmax runs in float32 (float64
for float64 inputs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..kv_quant import FP8_DTYPES
from ..masks import key_range, query_positions, range_mask
from ..paging import num_pages_for
from .base import AttentionBackend, AttentionParams, Capabilities
from .metadata import (
    GraphBuffers,
    MLADecodeMetadata,
    PagedMetadata,
    VarlenMetadata,
    graph_buffer_fields,
    graph_fields,
    paged_fields,
)


def masked_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None = None,
    *,
    empty_rows: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of ``scores`` where ``mask`` holds (broadcast), in ``scores.dtype``.

    ``sinks`` (broadcastable to ``scores[..., :1]``) adds one logit per row to the denominator.
    A row that sees nothing gets all-zero probabilities; ``empty_rows=False`` promises there is
    none and skips that check. ``return_lse`` also returns the log of each row's denominator
    (``scores.shape[:-1]``; sinks included, -inf for a row with neither keys nor sink).
    """
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:  # the fused softmax; rows that see nothing come out NaN and are zeroed
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(mask.any(dim=-1, keepdim=True), probs, 0.0) if empty_rows else probs
        return (probs, torch.logsumexp(scores, dim=-1)) if return_lse else probs
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # finite: the sink is
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True) + torch.exp(sinks - row_max)
    probs = probs / denom
    return (probs, (row_max + denom.log()).squeeze(-1)) if return_lse else probs


def visible_keys(
    q_pos: torch.Tensor, num_keys: int, params: AttentionParams, seq_lens_k: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, n, L]`` mask of the keys each query sees; ``seq_lens_k [B]`` hides padding past it."""
    lo, hi = key_range(
        q_pos,
        causal=params.causal,
        window_left=params.window_left,
        window_right=params.window_right,
        chunk=params.attention_chunk_size,
    )
    k_pos = torch.arange(num_keys, device=q_pos.device)
    mask = range_mask(lo, hi, k_pos)  # [B, n, L]
    if seq_lens_k is not None:
        mask &= (k_pos < seq_lens_k[:, None])[:, None, :]
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    params: AttentionParams,
    mask: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    empty_rows: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``B`` sequences over contiguous keys at positions ``0 .. L-1``.

    ``q [B, n, Hq, D]``, ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]``, ``q_pos [B, n]`` (int64) ->
    ``[B, n, Hq, Dv]`` in the accumulation dtype (float32, or float64 for float64 inputs), and with
    ``return_lse`` the natural-log LSE ``[B, n, Hq]``. ``mask [B, n, L]`` (default:
    :func:`visible_keys` of ``params``) may also hide padding keys, whose values must then be
    finite. A query that sees no key returns zeros. ``empty_rows``: whether a query may see no key
    (default: only where queries outnumber the keys, ``n > L``; a mask that hides padding says so
    itself). ``k`` and ``v`` may hold a quantised cache's stored values: ``params.k_scale``
    multiplies the scores and ``params.v_scale`` the output.
    """
    batch, n, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, value_dim = v.shape[1:]
    if num_keys == 0:  # no key to see: zeros, and the LSE of the sink alone (-inf without one)
        out = q.new_zeros((batch, n, num_q_heads, value_dim), dtype=_accumulate_dtype(q.dtype))
        if not return_lse:
            return out
        lse = out.new_full((batch, n, num_q_heads), float("-inf"))
        return out, lse if params.sinks is None else lse.copy_(params.sinks.to(lse.dtype).expand_as(lse))
    group = num_q_heads // num_kv_heads
    acc = _accumulate_dtype(q.dtype)
    k, v = k.to(acc), v.to(acc)

    qh = q.to(acc).view(batch, n, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)  # [Hkv, B, G, n, D]
    qh = qh.reshape(num_kv_heads, batch, group * n, head_dim)  # [Hkv, B, G*n, D]
    # One bmm per KV head over strided views of k and v: permuting the keys into a head-major
    # copy costs more than the products themselves.
    scores = q.new_empty((num_kv_heads, batch, group * n, num_keys), dtype=acc)
    for h in range(num_kv_heads):
        torch.bmm(qh[h], k[:, :, h].transpose(1, 2), out=scores[h])  # [B, G*n, L]
    scale = params.scale * params.k_scale  # an fp8 cache's K scale folded into the softmax scale
    scores = scores.mul_(scale).view(num_kv_heads, batch, group, n, num_keys)  # [Hkv, B, G, n, L]
    if params.logit_softcap > 0:
        scores = torch.tanh(scores / params.logit_softcap) * params.logit_softcap
    if params.alibi_slopes is not None:
        distance = (q_pos[:, :, None] - torch.arange(num_keys, device=q.device)).abs().to(acc)  # [B, n, L]
        slopes = params.alibi_slopes.to(acc).view(num_kv_heads, 1, group, 1, 1)
        scores = scores - slopes * distance[None, :, None]  # [Hkv, B, G, n, L]

    if mask is None:
        mask = visible_keys(q_pos, num_keys, params)  # [B, n, L]
    sinks = None if params.sinks is None else params.sinks.to(acc).view(num_kv_heads, 1, group, 1, 1)
    # Every query at a position p >= 0 sees key p under every mask rule; only more queries than
    # keys (positions below 0) can leave a row empty.
    if empty_rows is None:
        empty_rows = n > num_keys
    probs = masked_softmax(scores, mask[None, :, None], sinks, empty_rows=empty_rows, return_lse=return_lse)
    if return_lse:
        probs, lse = probs  # lse [Hkv, B, G, n]
    probs = probs.view(num_kv_heads, batch, group * n, num_keys)

    out = q.new_empty((num_kv_heads, batch, group * n, value_dim), dtype=acc)
    for h in range(num_kv_heads):
        torch.bmm(probs[h], v[:, :, h], out=out[h])  # [B, G*n, Dv]
    if params.v_scale != 1.0:
        out.mul_(params.v_scale)
    out = out.view(num_kv_heads, batch, group, n, value_dim).permute(1, 3, 0, 2, 4)  # [B, n, Hkv, G, Dv]
    out = out.reshape(batch, n, num_q_heads, value_dim)
    if not return_lse:
        return out
    return out, lse.permute(1, 3, 0, 2).reshape(batch, n, num_q_heads)  # [B, n, Hq]


# Decode batches are attended in groups of sequences padded to the group's longest: one gather and
# one matmul per KV head per group. This bounds the keys (padding included) a group may hold.
DECODE_GROUP_TOKENS = 1 << 12


@dataclass(frozen=True, eq=False)
class _DecodeGroup:
    """Per-forward gather plan of sequences ``b0:b1`` of a decode batch (shared by every layer).

    Keys past a sequence's length are named by ``pad_rows`` (a per-step plan) or by ``pad_mask``
    (a graph plan, whose lengths live on the device only).
    """

    b0: int
    b1: int
    pages: torch.Tensor  # [g * Pmax] page ids; unused columns point at page 0 (never seen)
    seq_lens_k: torch.Tensor  # [g] keys of each sequence (int64 per step, the buffers' int32 in a graph plan)
    pad_rows: torch.Tensor | None  # flat rows of the [g * Pmax * P] gathered keys that lie past a length
    q_pos: torch.Tensor  # [g, q] int64 positions of each sequence's q new tokens (q = 1 for a per-step plan)
    # (causal, window, chunk) -> [g, 1, L] mask, filled by layer 1; None: made per layer (a graph plan
    # is reused for every replay, so nothing computed from its buffers may be kept on the host side)
    masks: dict | None = field(default_factory=dict)
    pad_mask: torch.Tensor | None = None  # [g * Pmax * P] bool, True past a length
    # A sequence without keys (its query at position -1) sees nothing; padded beside longer ones it
    # is not caught by attend's own check (queries outnumbering the padded width).
    empty_rows: bool = False

    def mask(self, params: AttentionParams, num_keys: int) -> torch.Tensor:
        """The visible-key mask for ``params``: layers with the same mask rule share one per forward."""
        if self.masks is None:
            return visible_keys(self.q_pos, num_keys, params, self.seq_lens_k)
        rule = (params.causal, params.window_left, params.window_right, params.attention_chunk_size)
        if rule not in self.masks:
            self.masks[rule] = visible_keys(self.q_pos, num_keys, params, self.seq_lens_k)
        return self.masks[rule]

    def zero_padding(self, v: torch.Tensor) -> None:
        """Zero the gathered values ``v [g, Lmax, Hkv, Dv]`` past each length (they may hold NaN)."""
        flat = v.view(-1, *v.shape[2:])  # [g * Lmax, Hkv, Dv]
        if self.pad_rows is not None:
            flat.index_fill_(0, self.pad_rows, 0.0)
        else:
            flat.masked_fill_(self.pad_mask[:, None, None], 0.0)


def _decode_groups(metadata: PagedMetadata) -> list[_DecodeGroup]:
    page_size, device = metadata.page_size, metadata.seq_lens_k.device
    per_seq = num_pages_for(metadata.max_seqlen_k, page_size) * page_size
    step = max(1, DECODE_GROUP_TOKENS // max(per_seq, 1))
    groups = []
    for b0 in range(0, metadata.batch_size, step):
        b1 = min(b0 + step, metadata.batch_size)
        max_pages = num_pages_for(max(metadata.k_lens[b0:b1]), page_size)
        seq_lens_k = metadata.seq_lens_k[b0:b1].long()  # [g]
        used = torch.arange(max_pages, device=device) * page_size < seq_lens_k[:, None]  # [g, Pmax]
        pages = torch.where(used, metadata.page_table[b0:b1, :max_pages], 0).flatten()
        width = max_pages * page_size
        pad_rows = [b * width + j for b, n in enumerate(metadata.k_lens[b0:b1]) for j in range(n, width)]
        pad_rows = torch.tensor(pad_rows, dtype=torch.int64, device=device)
        q_pos = (seq_lens_k - 1)[:, None]  # [g, 1]
        empty = min(metadata.k_lens[b0:b1]) == 0
        groups.append(_DecodeGroup(b0, b1, pages, seq_lens_k, pad_rows, q_pos, empty_rows=empty))
    return groups


@dataclass(frozen=True, eq=False)
class TorchPagedMetadata(PagedMetadata):
    """The torch backend's paged plan: for a decode batch (one query per sequence; in a graph plan, a
    uniform batch of ``uniform_q_len``), the gather groups every layer shares (``None`` otherwise:
    sequences are attended one at a time)."""

    decode_groups: tuple[_DecodeGroup, ...] | None = None


@dataclass(frozen=True, eq=False)
class TorchGraphBuffers(GraphBuffers):
    """The gather plan of a captured uniform step, at full width ``L = max_pages * P``, per row: ``pages
    [max_batch_size, max_pages]`` (unused columns at page 0), ``pad_mask [max_batch_size, L]`` bool
    (True past a length) and ``q_pos [max_batch_size, max_uniform_q_len]`` int64 (the positions of
    the new tokens; a step of ``q`` reads the first ``q`` columns); the lengths are the base class's
    ``seq_lens_k``."""

    pages: torch.Tensor | None = None
    pad_mask: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None


def _graph_groups(buffers: TorchGraphBuffers, batch_size: int, uniform_q_len: int) -> tuple[_DecodeGroup, ...]:
    """Decode groups over views of the static buffers: every group spans the full width."""
    width = buffers.max_seqlen_k
    step = max(1, DECODE_GROUP_TOKENS // width)
    groups = []
    for b0 in range(0, batch_size, step):
        b1 = min(b0 + step, batch_size)
        groups.append(
            _DecodeGroup(
                b0,
                b1,
                pages=buffers.pages[b0:b1].flatten(),
                seq_lens_k=buffers.seq_lens_k[b0:b1],
                pad_rows=None,
                q_pos=buffers.q_pos[b0:b1, :uniform_q_len],
                masks=None,
                pad_mask=buffers.pad_mask[b0:b1].flatten(),
            )
        )
    return tuple(groups)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather_buffers(cache: torch.Tensor, max_pages: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    buf = cache.new_empty((max_pages, *cache.shape[1:]))
    acc = _accumulate_dtype(cache.dtype)
    return buf, (None if acc == cache.dtype else torch.empty(buf.shape, dtype=acc, device=buf.device))


def _gather(cache: torch.Tensor, pages: torch.Tensor, buf: torch.Tensor, acc_buf: torch.Tensor | None) -> torch.Tensor:
    """``cache[pages]`` into reused buffers, upcast to the accumulation dtype."""
    got = torch.index_select(cache, 0, pages, out=buf[: pages.shape[0]])
    return got if acc_buf is None else acc_buf[: pages.shape[0]].copy_(got)


class TorchBackend(AttentionBackend):
    name = "torch"
    priority = 0
    supports_graphs = True
    capabilities = Capabilities(
        ops=frozenset({"paged_attention", "varlen_attention", "mla_decode", "merge_attention_states"}),
        features=frozenset({"window", "chunk", "sinks", "softcap", "non_causal", "dv_ne_d", "lse", "alibi"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64}),
        kv_dtypes=frozenset(FP8_DTYPES),
    )

    def plan_paged(self, cu_seqlens_q, seq_lens_k, page_table, page_size, **kwargs) -> TorchPagedMetadata:
        """As the base class; a decode batch (one query per sequence) also gets its gather plan."""
        fields = paged_fields(cu_seqlens_q, seq_lens_k, page_table, page_size, host_lens=kwargs.get("host_lens"))
        metadata = TorchPagedMetadata(**fields)
        if metadata.batch_size and all(n == 1 for n in metadata.q_lens):
            metadata = dataclasses.replace(metadata, decode_groups=tuple(_decode_groups(metadata)))
        return metadata

    def init_graph_buffers(
        self,
        max_batch_size: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
        *,
        num_heads: int,
        max_uniform_q_len: int = 1,
    ) -> TorchGraphBuffers:
        width = max_pages * page_size
        fields = graph_buffer_fields(max_batch_size, max_pages, page_size, device, max_uniform_q_len=max_uniform_q_len)
        return TorchGraphBuffers(
            **fields,
            pages=torch.zeros((max_batch_size, max_pages), dtype=torch.int64, device=device),
            pad_mask=torch.arange(width, device=device).expand(max_batch_size, width) >= max_uniform_q_len,
            q_pos=torch.arange(max_uniform_q_len, device=device).repeat(max_batch_size, 1),  # [B, Q]
        )

    def graph_metadata(
        self,
        buffers: TorchGraphBuffers,
        batch_size: int,
        *,
        num_heads: int,
        uniform_q_len: int = 1,
        kv_dtype: torch.dtype | None = None,
        max_seqlen_k: int | None = None,
    ) -> TorchPagedMetadata:
        groups = _graph_groups(buffers, batch_size, uniform_q_len)
        fields = graph_fields(buffers, batch_size, uniform_q_len, max_seqlen_k)
        return TorchPagedMetadata(**fields, decode_groups=groups)

    def plan_into(
        self, buffers: TorchGraphBuffers, req_to_token, req_pool_indices, seq_lens_k, *, uniform_q_len: int = 1
    ) -> None:
        """As the base class, then the gather plan of every row from the lengths (device work only)."""
        super().plan_into(buffers, req_to_token, req_pool_indices, seq_lens_k, uniform_q_len=uniform_q_len)
        batch, page_size, device = req_pool_indices.shape[0], buffers.page_size, seq_lens_k.device
        seq_lens_k = seq_lens_k.long()  # [B]
        max_pages = buffers.page_table.shape[1]
        used = torch.arange(max_pages, device=device) * page_size < seq_lens_k[:, None]  # [B, max_pages]
        buffers.pages[:batch].copy_(torch.where(used, buffers.page_table[:batch], 0))
        width = buffers.pad_mask.shape[1]
        torch.ge(torch.arange(width, device=device), seq_lens_k[:, None], out=buffers.pad_mask[:batch])
        q_pos = seq_lens_k[:, None] + torch.arange(-uniform_q_len, 0, device=device)  # [B, q]
        buffers.q_pos[:batch, :uniform_q_len].copy_(q_pos)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: PagedMetadata,
        params: AttentionParams,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        groups = getattr(metadata, "decode_groups", None)  # metadata planned by another backend has none
        if groups is not None:
            return self._paged_decode(q, k_cache, v_cache, groups, params, out, lse)
        page_size = metadata.page_size
        # Gather buffers are allocated once per call: fresh allocations per sequence cost more
        # than the copies themselves.
        max_pages = num_pages_for(metadata.max_seqlen_k, page_size)
        k_bufs = _gather_buffers(k_cache, max_pages)
        v_bufs = _gather_buffers(v_cache, max_pages)
        start = 0
        for b, (n, num_keys) in enumerate(zip(metadata.q_lens, metadata.k_lens)):
            if n == 0:
                continue
            num_pages = num_pages_for(num_keys, page_size)
            pages = metadata.page_table[b, :num_pages]
            k = _gather(k_cache, pages, *k_bufs).flatten(0, 1)[:num_keys]  # [L, Hkv, D]
            v = _gather(v_cache, pages, *v_bufs).flatten(0, 1)[:num_keys]  # [L, Hkv, Dv]
            q_pos = query_positions(n, num_keys, q.device)
            rows = slice(start, start + n)
            _attend_into(out, lse, rows, q[None, rows], k[None], v[None], q_pos[None], params)
            start += n
        return out

    def _paged_decode(self, q, k_cache, v_cache, groups: tuple[_DecodeGroup, ...], params: AttentionParams, out, lse):
        """A uniform batch (every sequence ``q_len`` new tokens, ``q_len`` the groups' ``q_pos`` width)."""
        max_pages = max(g.pages.shape[0] for g in groups)
        k_bufs, v_bufs = _gather_buffers(k_cache, max_pages), _gather_buffers(v_cache, max_pages)
        for g in groups:
            num_seqs, q_len = g.q_pos.shape
            k = _gather(k_cache, g.pages, *k_bufs).view(num_seqs, -1, *k_cache.shape[2:])  # [g, Lmax, Hkv, D]
            v = _gather(v_cache, g.pages, *v_bufs).view(num_seqs, -1, *v_cache.shape[2:])  # [g, Lmax, Hkv, Dv]
            # Keys past a length are masked out of the scores (NaN included); their values must be
            # finite too, since 0 * NaN = NaN in the value product.
            g.zero_padding(v)
            mask = g.mask(params, k.shape[1])  # [g, q, Lmax]
            rows = slice(g.b0 * q_len, g.b1 * q_len)
            queries = q[rows].unflatten(0, (num_seqs, q_len))  # [g, q, Hq, D]
            _attend_into(
                out, lse, rows, queries, k, v, g.q_pos, params, mask=mask, batched=True, empty_rows=g.empty_rows
            )
        return out

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: VarlenMetadata,
        params: AttentionParams,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q_start = k_start = 0
        for n, num_keys in zip(metadata.q_lens, metadata.k_lens):
            if n > 0:
                q_pos = query_positions(n, num_keys, q.device)
                rows, keys = slice(q_start, q_start + n), slice(k_start, k_start + num_keys)
                _attend_into(out, lse, rows, q[None, rows], k[None, keys], v[None, keys], q_pos[None], params)
            q_start += n
            k_start += num_keys
        return out

    def mla_decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLADecodeMetadata,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        kv_scale: float = 1.0,
    ) -> torch.Tensor:
        """Absorbed MLA decode over a padded batch; ignores the split count and workspace.

        ``kv_scale`` (fp8 caches) multiplies the scores and the output, as the kernels do."""
        batch, _, rank = q_nope.shape
        if metadata.max_seqlen_k == 0:  # no keys anywhere (the cache or the table may be empty)
            if lse is not None:
                lse.fill_(float("-inf"))
            return out.zero_()
        page_size = metadata.page_size
        acc = _accumulate_dtype(q_nope.dtype)
        max_pages = max(1, num_pages_for(metadata.max_seqlen_k, page_size))
        pages = metadata.page_table[:, :max_pages]  # [B, Pmax]
        used = torch.arange(max_pages, device=pages.device) * page_size < metadata.seq_lens_k[:, None]
        pages = torch.where(used, pages, 0)  # unused columns may hold any id
        latent = kv_cache.index_select(0, pages.flatten()).flatten(0, 1).to(acc)  # [B*Pmax*P, R + Dr]
        latent = latent.view(batch, max_pages * page_size, -1)  # [B, Lmax, R + Dr]
        valid = torch.arange(latent.shape[1], device=pages.device) < metadata.seq_lens_k[:, None]  # [B, Lmax]
        latent = latent.masked_fill(~valid[..., None], 0.0)  # unowned slots may hold NaN

        q = torch.cat([q_nope, q_rope], dim=-1).to(acc)  # [B, H, R + Dr]
        scores = torch.bmm(q, latent.transpose(1, 2)).mul_(scale * kv_scale)  # [B, H, Lmax]
        probs, row_lse = masked_softmax(scores, valid[:, None, :], return_lse=True)  # empty sequences give zeros
        res = torch.bmm(probs, latent[..., :rank])  # [B, H, R]
        out.copy_(res if kv_scale == 1.0 else res.mul_(kv_scale))
        if lse is not None:
            lse.copy_(row_lse)  # [B, H]
        return out

    def merge_attention_states(
        self, outs: list[torch.Tensor], lses: list[torch.Tensor], out: torch.Tensor, out_lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = _accumulate_dtype(out.dtype)
        lse = torch.stack([x.to(acc) for x in lses])  # [N, T, H]
        top = lse.amax(dim=0)  # [T, H]
        top = torch.where(top == float("-inf"), 0.0, top)  # rows no part saw anything
        weights = torch.exp(lse - top)  # [N, T, H]; 0 for parts that saw nothing
        denom = weights.sum(dim=0)  # [T, H]
        total = torch.zeros(out.shape, dtype=acc, device=out.device)
        for w, part in zip(weights, outs):
            # A part with no weight contributes nothing, whatever its output holds.
            total += torch.where(w[..., None] > 0, w[..., None] * part.to(acc), 0.0)
        out.copy_(total / torch.where(denom > 0, denom, 1.0)[..., None])
        out_lse.copy_(torch.where(denom > 0, top + denom.log(), float("-inf")))
        return out, out_lse


def _attend_into(out, lse, rows, q, k, v, q_pos, params, mask=None, batched=False, empty_rows=None) -> None:
    """:func:`attend` into the query rows ``rows`` of ``out`` (and ``lse``): one sequence, or a uniform
    batch (``batched``: sequence-major rows)."""
    got = attend(q, k, v, q_pos, params, mask, return_lse=lse is not None, empty_rows=empty_rows)
    res, res_lse = got if lse is not None else (got, None)
    out[rows] = res.flatten(0, 1) if batched else res[0]  # [g * q, Hq, Dv] or [n, Hq, Dv]
    if lse is not None:
        lse[rows] = res_lse.flatten(0, 1) if batched else res_lse[0]
