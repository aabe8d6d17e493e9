"""The backend contract: declared capabilities, per-layer parameters, the backend class (the
per-forward metadata and graph buffers it plans are in :mod:`.metadata`).

A backend is one class. ``plan`` / ``plan_paged`` / ``plan_varlen`` run once per forward and do every
host sync (Python ints for max lengths, split counts); they return the backend's own typed metadata
(a subclass of :class:`PagedMetadata` / :class:`VarlenMetadata` with named fields for what its op
methods need). The op methods run once per layer and never sync. See docs/design.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..errors import is_int, is_real
from ..kv_quant import quantize_kv
from ..paging import num_pages_for, to_page_table
from .cache import LatentKVCache, PagedKVCache
from .cascade import cascades, run_cascade
from .metadata import (
    GraphBuffers,
    MLADecodeMetadata,
    PagedBatch,
    PagedMetadata,
    VarlenMetadata,
    graph_buffer_fields,
    graph_fields,
    paged_fields,
    varlen_fields,
)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do. ``None`` for a field means "any".

    ``kv_dtypes``: the quantised KV cache dtypes (fp8) the backend reads besides caches in the
    query's dtype; a backend that lists one applies the cache's scales (``AttentionParams.k_scale``,
    ``v_scale``, ``mla_decode``'s ``kv_scale``).
    """

    ops: frozenset[str]
    features: frozenset[str] = frozenset()
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    head_dims: frozenset[int] | None = None
    device_types: frozenset[str] | None = None
    kv_dtypes: frozenset[torch.dtype] = frozenset()

    def supports(self, kind: str, value: object) -> bool:
        if kind == "op":
            return value in self.ops
        if kind == "feature":
            return value in self.features
        if kind == "dtype":
            return value in self.dtypes
        if kind == "kv_dtype":
            return value in self.kv_dtypes
        if kind in ("head_dim", "value_dim"):
            return self.head_dims is None or value in self.head_dims
        if kind == "device":
            return self.device_types is None or value in self.device_types
        raise ValueError(f"unknown capability kind {kind!r}")


# Feature names, as they appear in UnsupportedFeatureError messages.
OPS = ("paged_attention", "varlen_attention", "mla_decode", "merge_attention_states")
FEATURES = {
    "window": "a sliding window (window_left / window_size)",
    "chunk": "chunked local attention (attention_chunk_size)",
    "sinks": "attention sinks",
    "softcap": "logit_softcap",
    "non_causal": "non-causal attention",
    "dv_ne_d": "a value head dim different from the key head dim",
    "lse": "the softmax log-sum-exp output (return_lse)",
    "alibi": "ALiBi slopes (alibi_slopes)",
}


@dataclass(frozen=True)
class Request:
    """What one call (or one model: ``extra_ops`` it also runs) needs; matched against :class:`Capabilities`.

    ``head_dim`` / ``value_dim`` ``None``: not matched (ops whose width is not a head dim, e.g. merging).
    ``kv_dtype``: a quantised KV cache dtype (fp8), ``None`` for a cache in ``dtype``.
    """

    op: str
    device_type: str
    dtype: torch.dtype
    head_dim: int | None
    features: frozenset[str] = frozenset()
    extra_ops: frozenset[str] = frozenset()
    value_dim: int | None = None
    kv_dtype: torch.dtype | None = None

    def missing(self, caps: Capabilities) -> tuple[str, object] | None:
        """The first requirement ``caps`` lacks, as ``(kind, value)``, or ``None``."""
        needs = [("op", op) for op in (self.op, *sorted(self.extra_ops))]
        needs += [("device", self.device_type), ("dtype", self.dtype)]
        needs += [("kv_dtype", self.kv_dtype)] if self.kv_dtype is not None else []
        needs += [
            (kind, dim) for kind, dim in (("head_dim", self.head_dim), ("value_dim", self.value_dim)) if dim is not None
        ]
        needs += [("feature", feature) for feature in sorted(self.features)]
        for kind, value in needs:
            if not caps.supports(kind, value):
                return kind, value
        return None


class MLARequest(Request):
    """A request for the ``mla_decode`` op (:func:`portattn.mla_decode`). MLA kernels take any latent
    width (``kv_lora_rank + rope_dim``), so a backend's head-dim list (which describes its attention
    kernels) is not matched; the op, device, dtype, cache dtype and features are."""

    def missing(self, caps: Capabilities) -> tuple[str, object] | None:
        needs = [("op", self.op), ("device", self.device_type), ("dtype", self.dtype)]
        needs += [("kv_dtype", self.kv_dtype)] if self.kv_dtype is not None else []
        needs += [("feature", feature) for feature in sorted(self.features)]
        return next(((kind, value) for kind, value in needs if not caps.supports(kind, value)), None)


def describe(kind: str, value: object) -> str:
    if kind == "op":
        return f"the {value} op"
    if kind == "feature":
        return FEATURES.get(str(value), str(value))
    if kind == "device":
        return f"device type {value!r}"
    if kind == "dtype":
        return f"dtype {value}"
    if kind == "kv_dtype":
        return f"a KV cache of dtype {value}"
    if kind == "value_dim":
        return f"value head dim {value}"
    return f"head dim {value}"


# An engine step's page table is a multiple of this many pages wide (or req_to_token's full width):
# Triton specializes an integer argument on whether 16 divides it, and a row stride that followed each
# step's longest sequence gave every attention kernel a second compiled variant, compiled while
# serving (benchmarks/results/engine_h200/round23/NOTES.md). The columns past a row's keys are never read.
TABLE_PAGES = 16


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """Per-layer attention parameters (see docs/design.md for the exact semantics).

    ``window_right`` only applies when not causal; -1 means unbounded, as for ``window_left``.
    ``alibi_slopes [Hq]`` adds ``-slope * |p - j|`` to the (scaled, softcapped) score of query
    position ``p`` and key ``j``. ``k_scale`` / ``v_scale``: the scales of a quantised (fp8) cache,
    whose stored values times the scale are the keys and values (1.0 for other caches).
    """

    scale: float
    causal: bool = True
    window_left: int = -1
    window_right: int = -1
    attention_chunk_size: int | None = None
    sinks: torch.Tensor | None = None  # [Hq], float
    logit_softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # [Hq], float
    k_scale: float = 1.0
    v_scale: float = 1.0

    def features(self, head_dim: int, value_dim: int) -> frozenset[str]:
        needed = set()
        if self.window_left >= 0 or (not self.causal and self.window_right >= 0):
            needed.add("window")
        if self.attention_chunk_size is not None:
            needed.add("chunk")
        if self.sinks is not None:
            needed.add("sinks")
        if self.logit_softcap > 0:
            needed.add("softcap")
        if not self.causal:
            needed.add("non_causal")
        if head_dim != value_dim:
            needed.add("dv_ne_d")
        if self.alibi_slopes is not None:
            needed.add("alibi")
        return frozenset(needed)


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """What one decoder layer's attention is, as a model describes it to the backend (built once per
    layer, held by the layer's attention module as ``spec``, passed to every backend ``forward``).

    ``window_left = W`` (-1: none; Hugging Face ``sliding_window = S`` is ``W = S - 1``),
    ``attention_chunk_size = C`` (absolute chunks), ``sinks [num_heads]`` and ``logit_softcap``
    follow docs/design.md. ``v_head_dim`` defaults to ``head_dim``.
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    v_head_dim: int | None = None
    window_left: int = -1
    attention_chunk_size: int | None = None
    sinks: torch.Tensor | None = None
    logit_softcap: float = 0.0
    params: AttentionParams = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("layer_id", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value < (0 if name == "layer_id" else 1):
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"expected num_heads divisible by num_kv_heads {self.num_kv_heads}, got {self.num_heads}")
        if not self.scale > 0:
            raise ValueError(f"expected a positive scale, got {self.scale}")
        if not is_int(self.window_left) or self.window_left < -1:
            raise ValueError(f"expected window_left to be an int >= -1, got {self.window_left!r}")
        if not (is_real(self.logit_softcap) and 0 <= self.logit_softcap < math.inf):
            raise ValueError(f"expected a finite logit_softcap >= 0, got {self.logit_softcap!r}")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ValueError(f"expected attention_chunk_size None or >= 1, got {self.attention_chunk_size}")
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        params = AttentionParams(
            scale=float(self.scale),
            window_left=self.window_left,
            attention_chunk_size=self.attention_chunk_size,
            sinks=self.sinks,
            logit_softcap=float(self.logit_softcap),
        )
        object.__setattr__(self, "params", params)

    @property
    def features(self) -> frozenset[str]:
        return self.params.features(self.head_dim, self.v_head_dim)


class AttentionBackend:
    """Base class of every attention backend.

    Subclasses set ``name`` and ``capabilities`` and implement the op methods their capabilities
    list. ``plan_paged`` / ``plan_varlen`` may be extended to precompute backend-specific launch
    facts, returned in a metadata subclass with named fields.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    priority: ClassVar[int] = 0  # auto picks the highest-priority available backend that fits
    supports_graphs: ClassVar[bool] = False  # implements the graph plan (graph_metadata, plan_into)

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        """Whether the backend imports and runs on ``device`` at all."""
        return True

    @classmethod
    def capabilities_on(cls, device: torch.device) -> Capabilities:
        """The capabilities on ``device``: ``capabilities``, less what this device cannot do (e.g. an
        fp8 format its compiler has no conversions for). Selection matches requests against these."""
        return cls.capabilities

    @classmethod
    def runs_natively(cls, device: torch.device) -> bool:
        """False where the backend only runs emulated (Triton's CPU interpreter): never chosen by auto."""
        return True

    def plan_paged(
        self,
        cu_seqlens_q: torch.Tensor,
        seq_lens_k: torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
        *,
        attention_chunk_size: int | None = None,
        num_heads: int | None = None,
        host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> PagedMetadata:
        return PagedMetadata(**paged_fields(cu_seqlens_q, seq_lens_k, page_table, page_size, host_lens=host_lens))

    def plan(
        self, batch: PagedBatch, *, num_heads: int | None = None, kv_dtype: torch.dtype | None = None
    ) -> PagedMetadata:
        """Engine entry point, once per forward: page table from ``req_to_token``, then ``plan_paged``.

        Every host sync of the forward happens here (``plan_paged`` reads the lengths, unless the
        batch carries host copies ``q_lens`` and ``k_lens``). ``num_heads`` (the model's query heads)
        and ``kv_dtype`` (the cache's) let a backend size its launches now rather than per layer.
        """
        pages = -(-num_pages_for(batch.max_seqlen_k, batch.page_size) // TABLE_PAGES) * TABLE_PAGES
        width = min(pages * batch.page_size, batch.req_to_token.shape[1])
        rows = batch.req_to_token[batch.req_pool_indices, :width]  # [B, width] token-granular
        page_table = to_page_table(rows, batch.page_size)  # [B, width / P] page-granular
        metadata = self.plan_paged(
            batch.cu_seqlens_q,
            batch.seq_lens_k,
            page_table,
            batch.page_size,
            attention_chunk_size=batch.attention_chunk_size,
            num_heads=num_heads,
            host_lens=(batch.q_lens, batch.k_lens) if getattr(batch, "k_lens", None) is not None else None,
            kv_dtype=kv_dtype,
        )
        return dataclasses.replace(metadata, out_cache_loc=batch.out_cache_loc)

    # -- the engine's entry points, once per layer -------------------------------------------
    # The backend is the one writer of the KV cache: ``forward``, ``forward_rotary`` and
    # ``forward_projected`` write the new tokens' K/V (through ``write_kv``, or as it would), the MLA
    # layer writes its latent rows through ``write_latent``.
    # A cache's scales come with its view (``kv_cache.k_scale``...), never as per-step arguments.

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        metadata: PagedMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Write the new K/V at ``metadata.out_cache_loc`` (:meth:`write_kv`), then attend (no
        validation, no sync).

        ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]``; ``kv_cache`` is the layer's
        :class:`PagedKVCache` (``k [num_pages, P, Hkv, D]``, ``v [num_pages, P, Hkv, Dv]``, in
        ``q``'s dtype or fp8, with its scales). Returns ``[T, Hq, Dv]``.
        """
        self.write_kv(k, v, kv_cache, metadata.out_cache_loc)
        params = spec.params
        if kv_cache.k_scale != 1.0 or kv_cache.v_scale != 1.0:
            params = dataclasses.replace(params, k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale)
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        return self.attend(q, kv_cache.k, kv_cache.v, metadata, params, out)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: PagedMetadata,
        params: AttentionParams,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """The attention step of :meth:`forward` (the cache already written): the cascade of
        ``metadata.cascade`` (a batch that shares a prefix, planned by the engine) where it computes
        ``params`` exactly (:func:`portattn.cascade.cascades`), else :meth:`paged_attention`."""
        if metadata.cascade is not None and cascades(params):
            return run_cascade(self, metadata.cascade, q, k_cache, v_cache, params, out)
        return self.paged_attention(q, k_cache, v_cache, metadata, params, out)

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec: AttentionSpec,
        metadata: PagedMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor | None:
        """:meth:`forward` of ``q`` and ``k`` rotated by the rotate-half embedding ``cos, sin [T, D]``
        (rows in ``q``'s dtype, the whole head), where the backend fuses the rotation with its cache
        write; ``None`` where it does not (the default: the caller rotates, then calls
        :meth:`forward`). A backend that returns a result rotates exactly as ``q * cos +
        rotate_half(q) * sin`` rounds in ``q``'s dtype, and writes what :meth:`write_kv` would.
        """
        return None

    def forward_projected(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec: AttentionSpec,
        metadata: PagedMetadata,
        kv_cache: PagedKVCache,
        *,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
        mode: str = "dtype",
        out_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """:meth:`forward_rotary` of the q/k/v projection of rows ``x [T, K]``, where the backend computes
        the projection, the rotation and the cache write in one launch: ``qkv = rmsnorm(x + residual)
        @ weight.T + bias`` (``weight = [W_q; W_k; W_v]``, ``[(Hq + 2 Hkv) D, K]``; the norm of
        ``norm_weight`` in ``mode`` as ``RMSNorm`` computes it, none without ``norm_weight``), split
        into heads. Returns ``(out [T, Hq, Dv], x + residual)`` (``None`` in place of the sum without a
        residual), or ``None`` where the backend does not (the default: the caller projects, then
        calls :meth:`forward_rotary` or :meth:`forward`). With ``out_weight`` (the layer's output
        projection ``[N, Hq * Dv]``, no bias, this rank's columns) the first element is
        ``out.flatten(1) @ out_weight.T [T, N]``, where the backend applies it in its own launches;
        ``None`` where it does not (the caller then asks without it), before anything is computed."""
        return None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache, slots: torch.Tensor) -> None:
        """Store new tokens' K/V: slot ``slots[t]`` (``page * P + offset``, int64 ``[T]``) of
        ``kv_cache.k`` / ``kv_cache.v`` gets ``k[t] [Hkv, D]`` / ``v[t] [Hkv, Dv]``; an fp8 cache
        stores ``saturate(k / k_scale)`` and ``saturate(v / v_scale)``
        (:func:`portattn.kv_quant.quantize_kv`), others the values cast to their dtype. A V cache with its
        keys contiguous in each page (``runtime.kv_cache.keys_contiguous_empty``) is written through its strides."""
        k_cache, v_cache = kv_cache.k, kv_cache.v
        k_cache.view(-1, *k_cache.shape[2:])[slots] = quantize_kv(k, k_cache.dtype, kv_cache.k_scale)  # [N * P, Hkv, D]
        v = quantize_kv(v, v_cache.dtype, kv_cache.v_scale)
        if v_cache.is_contiguous():
            v_cache.view(-1, *v_cache.shape[2:])[slots] = v  # [N * P, Hkv, Dv]
        else:
            page_size = v_cache.shape[1]
            v_cache[slots // page_size, slots % page_size] = v

    def write_latent(
        self, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: LatentKVCache, slots: torch.Tensor
    ) -> None:
        """Store new tokens' latent rows: slot ``slots[t]`` of ``kv_cache.latent [N, P, R + Dr]`` gets
        ``[c_kv[t] | k_pe[t]]`` (``c_kv [T, R]``, ``k_pe [T, Dr]``); an fp8 cache stores
        ``saturate(row / scale)``, others the row cast to their dtype."""
        rank = c_kv.shape[-1]
        rows = kv_cache.latent.view(-1, kv_cache.latent.shape[-1])  # [N * P, R + Dr]
        rows[slots, :rank] = quantize_kv(c_kv, rows.dtype, kv_cache.scale)
        rows[slots, rank:] = quantize_kv(k_pe, rows.dtype, kv_cache.scale)

    def write_latent_rotary(
        self,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LatentKVCache,
        slots: torch.Tensor,
        *,
        interleave: bool,
        norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor | None:
        """Multi-head latent attention's rope with :meth:`write_latent`, where the backend fuses them:
        ``q_pe [T, H, Dr]`` rotated (returned) and ``k_pe [T, Dr]`` rotated before ``[c_kv | k_pe]`` is
        stored, by ``cos, sin`` of ``PartialRotaryEmbedding.table`` (pairs with ``interleave``, else
        rotate-half); ``None`` where it does not (the default: the caller rotates, then calls
        :meth:`write_latent`). A backend that returns a result rotates exactly as
        ``PartialRotaryEmbedding.apply`` rounds in q's dtype and writes what :meth:`write_latent` would.
        ``norm``: ``(weight [R], eps)`` of an RMSNorm that ``c_kv`` goes through first (Llama's rounding:
        ``RMSNorm`` without ``unit_offset`` or ``weight_in_float32``), or ``None``; a backend that cannot
        fold it returns ``None`` and the caller normalizes."""
        return None

    # -- captured uniform decode (graphs) ------------------------------------------------------
    # A backend with ``supports_graphs`` plans uniform steps (``B`` sequences of ``uniform_q_len`` new
    # tokens each: decodes, or speculative verification) into static buffers: ``init_graph_buffers``
    # once, ``graph_metadata`` once per captured ``(batch_size, uniform_q_len)`` (its Python values are
    # then fixed for every replay), ``plan_into`` for each step (writes the step's lengths and tables
    # into the buffers; the engine records it in the step's graph, so it must be capturable: device work
    # of shapes fixed by the batch size and q). Its op methods must then read per-step facts from the
    # device only.

    def init_graph_buffers(
        self,
        max_batch_size: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
        *,
        num_heads: int,
        max_uniform_q_len: int = 1,
    ) -> GraphBuffers:
        """The static buffers of uniform steps of up to ``max_batch_size`` sequences of up to
        ``max_uniform_q_len`` new tokens each."""
        self._require_graphs()
        fields = graph_buffer_fields(max_batch_size, max_pages, page_size, device, max_uniform_q_len=max_uniform_q_len)
        return GraphBuffers(**fields)

    def graph_metadata(
        self,
        buffers: GraphBuffers,
        batch_size: int,
        *,
        num_heads: int,
        uniform_q_len: int = 1,
        kv_dtype: torch.dtype | None = None,
        max_seqlen_k: int | None = None,
    ) -> PagedMetadata:
        """The plan a captured uniform step of ``batch_size`` sequences of ``uniform_q_len`` new tokens
        reads: views of ``buffers`` (built once per shape; every replay reads what :meth:`plan_into`
        last wrote). Its ``max_seqlen_q`` is ``uniform_q_len``, its ``max_seqlen_k`` the buffers' width,
        or ``max_seqlen_k`` when given: a plan for steps whose rows hold at most that many keys (the
        engine's short shapes). ``kv_dtype``: the cache's, for backends whose launches depend on it."""
        self._require_graphs()
        return PagedMetadata(**graph_fields(buffers, batch_size, uniform_q_len, max_seqlen_k))

    def plan_into(
        self,
        buffers: GraphBuffers,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_k: torch.Tensor,
        *,
        uniform_q_len: int = 1,
    ) -> None:
        """Write one uniform step into the first ``B = len(req_pool_indices)`` rows of ``buffers``.

        ``req_to_token [max_reqs, max_context]`` int32 token-granular (``max_context = max_pages *
        P``); ``req_pool_indices [B]`` int64 rows of it; ``seq_lens_k [B]`` int32 keys per sequence,
        its ``q = uniform_q_len`` new tokens (at positions ``seq_lens_k - q .. seq_lens_k - 1``)
        included. Device work only, capturable in a graph (no host sync; shapes fixed by ``B`` and ``q``).
        """
        self._require_graphs()
        batch, q = req_pool_indices.shape[0], uniform_q_len
        buffers.check_shape(batch, q)
        rows = req_to_token.index_select(0, req_pool_indices)  # [B, max_context] token-granular
        buffers.page_table[:batch].copy_(to_page_table(rows, buffers.page_size))  # [B, max_pages]
        buffers.seq_lens_k[:batch].copy_(seq_lens_k)
        columns = seq_lens_k.long()[:, None] + torch.arange(-q, 0, device=rows.device)  # [B, q] new tokens
        buffers.out_cache_loc[: batch * q].copy_(rows.gather(1, columns).flatten())  # [B * q]

    def _require_graphs(self) -> None:
        if not self.supports_graphs:
            raise NotImplementedError(f"the {self.name} backend has no graph plan (supports_graphs is False)")

    def plan_varlen(
        self,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        *,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
    ) -> VarlenMetadata:
        return VarlenMetadata(**varlen_fields(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))

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
        """Attend into ``out [T, Hq, Dv]``; with ``lse [T, Hq]`` also write each row's natural-log LSE."""
        raise NotImplementedError(f"{self.name} does not implement paged_attention")

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
        raise NotImplementedError(f"{self.name} does not implement varlen_attention")

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
        """Absorbed MLA decode (one query per sequence, :func:`portattn.mla_decode`) into ``out [B, H, R]``.

        ``q_nope [B, H, R]``, ``q_rope [B, H, Dr]``; ``kv_cache [num_pages, P, R + Dr]`` latent rows
        ``[c_kv | k_pe]`` in ``q_nope``'s dtype or fp8 (the stored row times ``kv_scale`` is the row);
        ``metadata`` from ``portattn.mla.plan_mla_decode`` (page table, lengths, split count, workspace
        views). With ``lse [B, H]`` also write each row's natural-log LSE. Launch only: no sync.
        """
        raise NotImplementedError(f"{self.name} does not implement mla_decode")

    def merge_attention_states(
        self, outs: list[torch.Tensor], lses: list[torch.Tensor], out: torch.Tensor, out_lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge partial attentions ``outs[i] [T, H, Dv]`` with LSEs ``lses[i] [T, H]`` into ``out``, ``out_lse``."""
        raise NotImplementedError(f"{self.name} does not implement merge_attention_states")
