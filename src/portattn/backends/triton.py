"""The Triton backend: one kernel family for paged and varlen attention, split-KV for long decodes.

``plan_paged`` / ``plan_varlen`` do every host sync once per forward and return the launch facts
(longest query run, split count, per-sequence key counts) as :class:`TritonPagedMetadata` /
:class:`TritonVarlenMetadata`; the op methods only launch kernels.
 Runs on any device Triton compiles for (NVIDIA and AMD as ``cuda``, Intel as
``xpu``) and on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..device import is_gpu, is_triton_interpreter, triton_fp8_dtypes
from ..kv_quant import FP8_DTYPES
from .base import AttentionBackend, AttentionParams, AttentionSpec, Capabilities
from .cache import LatentKVCache, PagedKVCache
from .metadata import (
    GraphBuffers,
    MLADecodeMetadata,
    PagedMetadata,
    VarlenMetadata,
    graph_fields,
    paged_fields,
    varlen_fields,
)

try:
    from ..kernels.triton import fused_launch
    from ..kernels.triton.fused_launch import (
        NORM_LINEAR_ROWS,
        NORM_LINEAR_SINGLE_K,
        latent_rotary_write,
        merge_linear,
        merge_linear_fits,
        norm_linear_rotary,
        rotary_kv_write,
        row_linear_rotary,
    )
    from ..kernels.triton.launch import (
        attention_forward,
        choose_num_kv_splits,
        merge_states_forward,
        short_splits,
        split_partials,
    )
    from ..kernels.triton.mla_decode_launch import mla_decode_forward
except ImportError as exc:  # the registry reports this with the install hint
    raise ImportError(f"the triton backend needs the triton package ({exc})") from exc


def _attend(q, k, v, out, lse, metadata, seq_lens_k, params: AttentionParams, **layout) -> torch.Tensor:
    """``attention_forward`` of one op call: the query runs of ``metadata``, the keys of ``seq_lens_k``,
    every rule of ``params``; ``layout`` is ``page_table=`` and ``num_kv_splits=`` (paged) or
    ``kv_start=`` (contiguous K/V)."""
    return attention_forward(
        q,
        k,
        v,
        out,
        metadata.cu_seqlens_q,
        seq_lens_k,
        max_seqlen_q=metadata.max_seqlen_q,
        scale=params.scale,
        causal=params.causal,
        window_left=params.window_left,
        window_right=params.window_right,
        chunk_size=params.attention_chunk_size,
        sinks=params.sinks,
        logit_softcap=params.logit_softcap,
        alibi_slopes=params.alibi_slopes,
        lse=lse,
        k_scale=params.k_scale,
        v_scale=params.v_scale,
        max_seqlen_k=metadata.max_seqlen_k,
        **layout,
    )


def _planned_splits(metadata: PagedMetadata, num_heads, kv_itemsize, num_kv_splits=None) -> int:
    """``choose_num_kv_splits`` over the plan's host ints (``num_kv_splits`` forces a count)."""
    return choose_num_kv_splits(
        metadata.max_seqlen_k,
        metadata.batch_size,
        num_heads,
        metadata.max_seqlen_q,
        num_kv_splits=num_kv_splits,
        kv_itemsize=kv_itemsize,
    )


def _split_count(metadata: PagedMetadata, num_heads: int, kv_itemsize: int) -> int:
    """The plan's split count; metadata planned without the head count, or by another backend, has
    none: then chosen from the same host ints."""
    num_kv_splits = getattr(metadata, "num_kv_splits", None)
    return _planned_splits(metadata, num_heads, kv_itemsize) if num_kv_splits is None else num_kv_splits


@dataclass(frozen=True, eq=False)
class TritonPagedMetadata(PagedMetadata):
    """``num_kv_splits``: key ranges per (query block, KV head); ``None`` when planned without the head
    count (the op method then chooses from the same host ints and the query's heads, no sync).

    ``parts``: a mixed batch (the engine's: decodes first, then prompt chunks) is launched in two parts,
    ``(query rows, plan)`` each: the decodes with decode tiles and their own split count, the rest
    with prefill tiles. In one launch every decode would take a program of prefill tiles (a 128-row
    block for its one token) over all of its keys. ``None``: one launch."""

    num_kv_splits: int | None = None
    parts: tuple[tuple[slice, TritonPagedMetadata], ...] | None = None
    # the launches of this plan, kept for the next layer's (``attention_forward(memo=)``); a copy of the
    # plan (dataclasses.replace) starts its own
    launches: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def launch_key(self) -> tuple:
        """The split count, and whether each split holds few enough keys for short-decode tiles
        (``launch.short_splits``, judged as for a 16-bit cache: an fp8 cache's launches keep their
        tiles, so its key may differ where its launches do not, which costs a graph, never a result)."""
        splits = self.num_kv_splits
        short = splits is not None and short_splits(self.max_seqlen_q, self.max_seqlen_k, splits, 2)
        return (splits, short)


def _mixed_parts(metadata: TritonPagedMetadata, num_heads, kv_itemsize) -> tuple | None:
    """``TritonPagedMetadata.parts`` of a batch whose leading sequences decode (one query each) and
    whose others run more queries; ``None`` for any other batch (or without host lengths)."""
    q_lens, k_lens = metadata.q_lens, metadata.k_lens
    if q_lens is None or metadata.max_seqlen_q <= 1 or q_lens[0] != 1:
        return None
    d = next(i for i, n in enumerate(q_lens) if n != 1)  # decodes: rows and sequences 0 .. d - 1
    parts = []
    # the decodes' rows are their sequences' (one query each)
    for cu, seqs in ((metadata.cu_seqlens_q[: d + 1], slice(0, d)), (metadata.cu_seqlens_q[d:] - d, slice(d, None))):
        part = TritonPagedMetadata(
            cu_seqlens_q=cu,
            seq_lens_k=_aligned(metadata.seq_lens_k[seqs]),
            page_table=_aligned(metadata.page_table[seqs]),
            page_size=metadata.page_size,
            max_seqlen_q=max(q_lens[seqs]),
            max_seqlen_k=max(k_lens[seqs]),
            q_lens=q_lens[seqs],
            k_lens=k_lens[seqs],
        )
        if num_heads is not None:
            part = dataclasses.replace(part, num_kv_splits=_planned_splits(part, num_heads, kv_itemsize))
        parts.append((seqs, part))
    return tuple(parts)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where its address is not a multiple of 16 bytes: the kernels are compiled for
    aligned pointers (Triton specializes on it), and a view at another offset would be a variant of its
    own, compiled when a step first makes one (here: the rows of a mixed batch after ``d`` decodes)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


@dataclass(frozen=True, eq=False)
class TritonVarlenMetadata(VarlenMetadata):
    """``seq_lens_k [B]`` int32 on the device: the key count of each sequence."""

    seq_lens_k: torch.Tensor | None = None


# Every multiple of 8 up to 256. Column tiles of at least 16 (launch.column_tiles) cover a dim exactly
# or with 8 masked columns (40 = 32 + 16 - 8, 72 = 64 + 16 - 8); 240 takes one 256-wide tile.
HEAD_DIMS = frozenset(range(8, 257, 8))


class TritonBackend(AttentionBackend):
    name = "triton"
    priority = 10
    supports_graphs = True
    capabilities = Capabilities(
        ops=frozenset({"paged_attention", "varlen_attention", "mla_decode", "merge_attention_states"}),
        features=frozenset({"window", "chunk", "sinks", "softcap", "non_causal", "dv_ne_d", "lse", "alibi"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        # Masked column tiles gave wrong 16-bit results on an H200 while the row strides were not
        # known to be multiples of 8 (head dim 40: max error 0.72; 72: an illegal access); the
        # launcher now passes that alignment to the kernel (launch.row_alignment).
        head_dims=HEAD_DIMS,
        device_types=frozenset({"cuda", "xpu", "cpu"}),
        # fp8 K/V are converted to the query's dtype in registers (Triton's fp8 conversions: NVIDIA
        # from sm_89 for e4m3, see capabilities_on; AMD and Intel as their Triton backends provide them).
        kv_dtypes=frozenset(FP8_DTYPES),
    )

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        device = torch.device(device)
        return is_gpu(device) or (device.type == "cpu" and is_triton_interpreter())

    @classmethod
    def runs_natively(cls, device: torch.device) -> bool:
        return is_gpu(device)

    @classmethod
    def capabilities_on(cls, device: torch.device) -> Capabilities:
        """Without the fp8 formats Triton's backend does not declare for this GPU's architecture (e4m3
        before NVIDIA's sm_89)."""
        known = triton_fp8_dtypes(device)
        if known is None or cls.capabilities.kv_dtypes <= known:
            return cls.capabilities
        return dataclasses.replace(cls.capabilities, kv_dtypes=cls.capabilities.kv_dtypes & known)

    def plan_paged(
        self,
        cu_seqlens_q: torch.Tensor,
        seq_lens_k: torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
        *,
        attention_chunk_size: int | None = None,
        num_heads: int | None = None,
        num_kv_splits: int | None = None,
        host_lens=None,
        kv_dtype: torch.dtype | None = None,
    ) -> TritonPagedMetadata:
        """As the base class, plus the split count (``num_kv_splits`` forces one, for tests and benchmarks).

        Without ``num_heads`` (the engine's ``plan``) the split count is left to the op method,
        which computes it from the same host ints and the query's head count (no sync).
        """
        fields = paged_fields(cu_seqlens_q, seq_lens_k, page_table, page_size, host_lens=host_lens)
        metadata = TritonPagedMetadata(**fields)
        kv_itemsize = None if kv_dtype is None else kv_dtype.itemsize
        parts = None if num_kv_splits is not None else _mixed_parts(metadata, num_heads, kv_itemsize)
        if num_kv_splits is not None or num_heads is not None:
            num_kv_splits = _planned_splits(metadata, num_heads, kv_itemsize, num_kv_splits)
        return dataclasses.replace(metadata, num_kv_splits=num_kv_splits, parts=parts)

    def graph_metadata(
        self,
        buffers: GraphBuffers,
        batch_size: int,
        *,
        num_heads: int,
        uniform_q_len: int = 1,
        kv_dtype: torch.dtype | None = None,
        max_seqlen_k: int | None = None,
    ) -> TritonPagedMetadata:
        """As the base class, with the split count fixed for the shape: chosen for ``uniform_q_len``
        queries per sequence and the longest context a row can hold (``max_seqlen_k``, else the
        buffers' width). The kernel cuts each sequence's keys into that many ranges from its length on
        the device, so shorter contexts leave some splits empty (merged as nothing)."""
        itemsize = None if kv_dtype is None else kv_dtype.itemsize
        fields = graph_fields(buffers, batch_size, uniform_q_len, max_seqlen_k)
        longest = fields["max_seqlen_k"]
        splits = choose_num_kv_splits(longest, batch_size, num_heads, uniform_q_len, kv_itemsize=itemsize)
        return TritonPagedMetadata(**fields, num_kv_splits=splits)

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
        """One launch rotates q and k and writes K/V to their slots (``kernels/triton/fused_rotary.py``),
        then attention. ``None`` for an fp8 cache: the fused kernel stores plain casts, not the
        saturated, scaled values of :meth:`write_kv`."""
        if kv_cache.k.dtype != q.dtype:
            return None
        q = rotary_kv_write(q, k, v, cos, sin, kv_cache.k, kv_cache.v, metadata.out_cache_loc)  # [T, Hq, D]
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        return self.attend(q, kv_cache.k, kv_cache.v, metadata, spec.params, out)

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
        """One launch (``fused_launch.latent_rotary_write``) rotates q_pe and k_pe and stores the latent
        rows, through ``norm`` where given. ``None`` for a cache of another dtype than q's (fp8:
        :meth:`write_latent` saturates and scales), tables or a norm weight of another dtype."""
        if not (kv_cache.latent.dtype == q_pe.dtype == c_kv.dtype == k_pe.dtype == cos.dtype == sin.dtype):
            return None
        weight, eps = norm if norm is not None else (None, 0.0)
        if weight is not None and weight.dtype != q_pe.dtype:
            return None
        return latent_rotary_write(q_pe, c_kv, k_pe, cos, sin, kv_cache.latent, slots, interleave=interleave,
                                   norm_weight=weight, eps=eps)  # fmt: skip

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
        """The projection, rotation and cache write in one launch (``norm_linear_rotary``) for forwards
        of at most ``NORM_LINEAR_ROWS`` tokens over at most ``NORM_LINEAR_SINGLE_K`` features, or
        (``row_linear_rotary``, with ``ROW_LINEAR_ROTARY``) of one token over at least ``ROW_LINEAR_K``
        features, into a
        cache of their dtype, heads of a multiple of 16 (K and V alike); then attention. ``None``
        otherwise. With ``out_weight``: where the attention splits its keys (no cascade, no sinks, the
        partials small enough for ``merge_linear_fits``), the merge and the output projection in one
        launch (``merge_linear``) after it; ``None`` elsewhere."""
        rows, features = x.shape
        row = fused_launch.ROW_LINEAR_ROTARY and rows == 1 and features >= fused_launch.ROW_LINEAR_K
        if (
            (not row and (rows > NORM_LINEAR_ROWS or features > NORM_LINEAR_SINGLE_K))
            or kv_cache.k.dtype != x.dtype
            or spec.head_dim != spec.v_head_dim
            or spec.head_dim % 16
        ):
            return None
        params = spec.params
        if out_weight is not None:
            splits = _split_count(metadata, spec.num_heads, kv_cache.k.element_size())
            if (
                splits < 2
                or metadata.cascade is not None
                or params.sinks is not None
                or out_weight.dtype != x.dtype
                or tuple(out_weight.shape[1:]) != (spec.num_heads * spec.v_head_dim,)
                or not merge_linear_fits(spec.num_heads, splits, spec.v_head_dim)
            ):
                return None
        q, summed = (row_linear_rotary if row else norm_linear_rotary)(
            x, weight, bias, cos, sin, kv_cache.k, kv_cache.v, metadata.out_cache_loc,
            num_q_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, norm_weight=norm_weight, eps=eps,
            residual=residual, mode=mode,
        )  # fmt: skip
        out = q.new_empty((rows, spec.num_heads, spec.v_head_dim))
        if out_weight is None:
            return self.attend(q, kv_cache.k, kv_cache.v, metadata, params, out), summed
        partials = split_partials(rows, spec.num_heads, splits, spec.v_head_dim, x.device)
        _attend(q, kv_cache.k, kv_cache.v, out, None, metadata, metadata.seq_lens_k, params,
                page_table=metadata.page_table, num_kv_splits=splits, unmerged=partials)  # fmt: skip
        return merge_linear(*partials, out_weight), summed

    def plan_varlen(
        self,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        *,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
    ) -> TritonVarlenMetadata:
        fields = varlen_fields(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return TritonVarlenMetadata(**fields, seq_lens_k=cu_seqlens_k[1:] - cu_seqlens_k[:-1])  # [B] int32

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
        parts = getattr(metadata, "parts", None)
        if parts is not None:
            for rows, part in parts:
                part_lse = None if lse is None else lse[rows]
                self.paged_attention(q[rows], k_cache, v_cache, part, params, out[rows], part_lse)
            return out
        num_kv_splits = _split_count(metadata, q.shape[1], k_cache.element_size())
        return _attend(
            q,
            k_cache,
            v_cache,
            out,
            lse,
            metadata,
            metadata.seq_lens_k,
            params,
            page_table=metadata.page_table,
            num_kv_splits=num_kv_splits,
            memo=getattr(metadata, "launches", None),
        )

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
        seq_lens_k = getattr(metadata, "seq_lens_k", None)  # from plan_varlen; metadata built elsewhere lacks it
        if seq_lens_k is None:
            seq_lens_k = metadata.cu_seqlens_k[1:] - metadata.cu_seqlens_k[:-1]
        return _attend(q, k, v, out, lse, metadata, seq_lens_k, params, kv_start=metadata.cu_seqlens_k[:-1])

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache, slots: torch.Tensor) -> None:
        """:meth:`AttentionBackend.write_kv` in one launch (``fused_launch.kv_write``) where the caches are
        contiguous and of the new tokens' dtype; else the base class's writes (an fp8 cache's scales, a V cache
        with its keys contiguous in each page)."""
        k_cache, v_cache = kv_cache.k, kv_cache.v
        if (
            k_cache.dtype == v_cache.dtype == k.dtype == v.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and k.stride(-1) == 1
            and v.stride(-1) == 1
        ):
            fused_launch.kv_write(k, v, k_cache, v_cache, slots)
            return
        super().write_kv(k, v, kv_cache, slots)

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
        return mla_decode_forward(
            q_nope,
            q_rope,
            kv_cache,
            metadata.page_table,
            metadata.seq_lens_k,
            out,
            scale=scale,
            num_kv_splits=metadata.num_kv_splits,
            partials=metadata.partials,
            lse=lse,
            kv_scale=kv_scale,
            min_split_keys=metadata.min_split_keys,
            fewer_splits=metadata.splits_chosen,
        )

    def merge_attention_states(
        self, outs: list[torch.Tensor], lses: list[torch.Tensor], out: torch.Tensor, out_lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairwise merges; intermediate states stay in float32 (``out`` is rounded once)."""
        if len(outs) == 1:
            return out.copy_(outs[0]), out_lse.copy_(lses[0])
        if len(outs) > 2:  # one float32 state, merged into in place (a program reads its row, then writes it)
            tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
            tmp_lse = torch.empty(out_lse.shape, dtype=torch.float32, device=out.device)
        acc_out, acc_lse = outs[0], lses[0]
        for i in range(1, len(outs)):
            last = i == len(outs) - 1
            dst, dst_lse = (out, out_lse) if last else (tmp, tmp_lse)
            merge_states_forward(acc_out, acc_lse, outs[i], lses[i], dst, dst_lse)
            acc_out, acc_lse = dst, dst_lse
        return out, out_lse
