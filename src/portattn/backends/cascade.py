"""Cascade attention as a backend runs it: a cascade's plan (:class:`CascadeMetadata`), the layer
parameters it computes exactly (:func:`cascades`), and its two passes and merge (:func:`run_cascade`).
``portattn.cascade`` plans it (``plan_cascade``), holds the public op and re-exports these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .metadata import PagedMetadata

if TYPE_CHECKING:
    from .base import AttentionBackend, AttentionParams


@dataclass(frozen=True, eq=False)
class CascadeMetadata:
    """The two paged passes of a cascade, planned once per forward (``portattn.cascade.plan_cascade``)."""

    shared: PagedMetadata | None  # every query over the shared pages, as one sequence; None: no shared prefix
    own: PagedMetadata  # each request over its own keys (its page-table row past the shared pages)
    shared_prefix_len: int


def cascades(params: AttentionParams) -> bool:
    """Whether a cascade computes attention with ``params`` exactly: not with a window, a chunk or
    ALiBi, which depend on key positions that the shared pass does not keep."""
    windowed = params.window_left >= 0 or (not params.causal and params.window_right >= 0)
    return not windowed and params.attention_chunk_size is None and params.alibi_slopes is None


def run_cascade(
    backend: AttentionBackend,
    metadata: CascadeMetadata,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    params: AttentionParams,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The shared pass, the own pass and their merge into ``out [T, Hq, Dv]`` (and ``lse [T, Hq]``); no sync.

    ``params`` must be causal or not, with softcap and sinks but no window, chunk or ALiBi (those
    depend on positions, which the shared pass does not keep). Sinks go into the own pass only.
    """
    if metadata.shared is None:
        if lse is None:
            return backend.paged_attention(q, k_cache, v_cache, metadata.own, params, out)
        return backend.paged_attention(q, k_cache, v_cache, metadata.own, params, out, lse=lse)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # partial states are not rounded
    shape = (q.shape[0], q.shape[1], v_cache.shape[-1])
    shared_out, own_out = (torch.empty(shape, dtype=acc, device=q.device) for _ in range(2))
    shared_lse, own_lse = (torch.empty(shape[:2], dtype=acc, device=q.device) for _ in range(2))
    shared_params = dataclasses.replace(params, causal=False, sinks=None)
    backend.paged_attention(q, k_cache, v_cache, metadata.shared, shared_params, shared_out, lse=shared_lse)
    backend.paged_attention(q, k_cache, v_cache, metadata.own, params, own_out, lse=own_lse)
    merged_lse = torch.empty_like(own_lse) if lse is None else lse
    backend.merge_attention_states([shared_out, own_out], [shared_lse, own_lse], out, merged_lse)
    return out
