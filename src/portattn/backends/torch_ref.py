"""The PyTorch reference backend: every feature, any device, any page size.

This is the executable specification of portattn's semantics. It gathers each sequence's keys
page by page, then runs one batched matmul per sequence (no loop over tokens or pages), with the
softmax in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..masks import key_range, query_positions, range_mask
from ..paging import num_pages_for
from .base import AttentionBackend, AttentionParams, Capabilities, PagedMetadata, VarlenMetadata

if TYPE_CHECKING:
    from ..mla import MLADecodeMetadata


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, params: AttentionParams
) -> torch.Tensor:
    """Attention of one sequence over contiguous keys at positions ``0 .. L-1``.

    ``q [n, Hq, D]``, ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]``, ``q_pos [n]`` -> ``[n, Hq, Dv]`` in
    ``q.dtype``. A query that sees no key returns zeros.
    """
    n, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, value_dim = v.shape
    group = num_q_heads // num_kv_heads
    acc = _accumulate_dtype(q.dtype)

    qh = q.to(acc).view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    qh = qh.reshape(num_kv_heads, group * n, head_dim)  # [Hkv, G*n, D]
    kh = k.to(acc).permute(1, 2, 0)  # [Hkv, D, L]
    vh = v.to(acc).permute(1, 0, 2)  # [Hkv, L, Dv]
    scores = torch.bmm(qh, kh).mul_(params.scale)  # [Hkv, G*n, L]
    scores = scores.view(num_kv_heads, group, n, num_keys)  # [Hkv, G, n, L]
    if params.logit_softcap > 0:
        scores = torch.tanh(scores / params.logit_softcap) * params.logit_softcap

    lo, hi = key_range(
        q_pos,
        causal=params.causal,
        window_left=params.window_left,
        window_right=params.window_right,
        chunk=params.attention_chunk_size,
    )
    mask = range_mask(lo, hi, torch.arange(num_keys, device=q.device))  # [n, L]
    scores = scores.masked_fill(~mask, float("-inf"))

    row_max = scores.amax(dim=-1, keepdim=True)  # [Hkv, G, n, 1]
    if params.sinks is not None:
        sinks = params.sinks.to(acc).view(num_kv_heads, group, 1, 1)
        row_max = torch.maximum(row_max, sinks)
    row_max = torch.where(torch.isinf(row_max), 0.0, row_max)  # rows that see nothing
    probs = torch.exp(scores - row_max)  # [Hkv, G, n, L]
    denom = probs.sum(dim=-1, keepdim=True)
    if params.sinks is not None:
        denom = denom + torch.exp(sinks - row_max)
    probs = probs / torch.where(denom == 0, 1.0, denom)

    out = torch.bmm(probs.view(num_kv_heads, group * n, num_keys), vh)  # [Hkv, G*n, Dv]
    out = out.view(num_kv_heads, group, n, value_dim).permute(2, 0, 1, 3)  # [n, Hkv, G, Dv]
    return out.reshape(n, num_q_heads, value_dim).to(q.dtype)


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
    capabilities = Capabilities(
        ops=frozenset({"paged_attention", "varlen_attention", "mla_decode"}),
        features=frozenset({"window", "chunk", "sinks", "softcap", "non_causal", "dv_ne_d"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64}),
    )

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: PagedMetadata,
        params: AttentionParams,
        out: torch.Tensor,
    ) -> torch.Tensor:
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
            out[start : start + n] = attend(q[start : start + n], k, v, q_pos, params)
            start += n
        return out

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: VarlenMetadata,
        params: AttentionParams,
        out: torch.Tensor,
    ) -> torch.Tensor:
        q_start = k_start = 0
        for n, num_keys in zip(metadata.q_lens, metadata.k_lens):
            if n > 0:
                q_pos = query_positions(n, num_keys, q.device)
                out[q_start : q_start + n] = attend(
                    q[q_start : q_start + n],
                    k[k_start : k_start + num_keys],
                    v[k_start : k_start + num_keys],
                    q_pos,
                    params,
                )
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
    ) -> torch.Tensor:
        """Absorbed MLA decode over a padded batch; ignores the split count and workspace."""
        batch, _, rank = q_nope.shape
        if batch == 0:
            return out
        page_size = metadata.page_size
        acc = _accumulate_dtype(q_nope.dtype)
        max_pages = max(1, num_pages_for(metadata.max_seq_len, page_size))
        pages = metadata.page_table[:, :max_pages]  # [B, Pmax]
        used = torch.arange(max_pages, device=pages.device) * page_size < metadata.seq_lens[:, None]
        pages = torch.where(used, pages, 0)  # unused columns may hold any id
        latent = kv_cache.index_select(0, pages.flatten()).flatten(0, 1).to(acc)  # [B*Pmax*P, R + Dr]
        latent = latent.view(batch, max_pages * page_size, -1)  # [B, Lmax, R + Dr]
        valid = torch.arange(latent.shape[1], device=pages.device) < metadata.seq_lens[:, None]  # [B, Lmax]
        latent = latent.masked_fill(~valid[..., None], 0.0)  # unowned slots may hold NaN

        q = torch.cat([q_nope, q_rope], dim=-1).to(acc)  # [B, H, R + Dr]
        scores = torch.bmm(q, latent.transpose(1, 2)).mul_(scale)  # [B, H, Lmax]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), 0.0, row_max)  # empty sequences
        probs = torch.exp(scores - row_max)
        denom = probs.sum(dim=-1, keepdim=True)
        probs = probs / torch.where(denom == 0, 1.0, denom)
        out.copy_(torch.bmm(probs, latent[..., :rank]))  # [B, H, R]
        return out
