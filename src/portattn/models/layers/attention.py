"""Decoder self-attention over the paged KV cache.

:class:`PagedAttention` hands one layer's ``q, k, v`` to the backend (the one writer of the cache:
it stores K/V and attends, and may fuse the rotary embedding with its write); :class:`SelfAttention`
is the layer the Llama-style families share: merged q/k/v projection (biases as configured),
optional per-head RMSNorm of q and k, rotary, attention, output projection. Llama, Qwen2 (q/k/v
biases), Qwen3 (q/k norm) and the Qwen2.5-VL language model are configurations of it.

Under tensor parallelism the heads are split (:class:`~portattn.models.layers.linear.QKVLinear`):
``spec`` holds this rank's head counts, the paged cache holds this rank's KV heads, and ``o_proj`` is
row-parallel (the layer's one all-reduce).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...backends.base import AttentionSpec
from ...distributed.group import TPGroup, tp_or_single
from ...runtime.context import ForwardContext
from .fp8_linear import FP8Rows
from .fused import fused_ops
from .linear import (
    QKVLinear,
    RowParallelLinear,
    as_tensor,
    copy_checked,
    new_parameter,
    norm_folds,
    norm_then_linear,
    project,
    row_norm_folds,
    shard_of,
)
from .norm import RMSNorm

# Where the backend can (AttentionBackend.forward_projected), small forwards whose attention splits its
# keys merge the splits inside the output projection (one launch for two). On an H200 SmolLM2's batch-1
# decode graph over 162 keys took 793 us against 929, over 5 keys 713 against 748
# (benchmarks/results/engine_h200/round8/NOTES.md);
# ``python -m benchmarks.engine --kernel-options unfused_out_proj`` turns it off for a run.
FOLD_OUT_PROJ = True


class PagedAttention(nn.Module):
    """One layer's attention over its paged cache, through the forward's backend (which writes the new
    K/V into the cache, with the cache's scales, and attends)."""

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        spec = self.spec
        q = q.view(-1, spec.num_heads, spec.head_dim)  # [T, Hq, D]
        k = k.view(-1, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, D]
        v = v.view(-1, spec.num_kv_heads, spec.v_head_dim)  # [T, Hkv, Dv]
        out = ctx.backend.forward(q, k, v, spec, ctx.metadata, ctx.kv_cache(spec.layer_id))
        return out.flatten(1)  # [T, Hq * Dv]

    def forward_rotary(self, q, k, v, cos, sin, ctx: ForwardContext) -> torch.Tensor | None:
        """:meth:`forward` of q and k rotated by ``cos, sin`` where the backend fuses the rotation with
        its cache write (``AttentionBackend.forward_rotary``); ``None`` where it does not (the caller
        then rotates and calls :meth:`forward`)."""
        spec = self.spec
        q = q.view(-1, spec.num_heads, spec.head_dim)  # [T, Hq, D]
        k = k.view(-1, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, D]
        v = v.view(-1, spec.num_kv_heads, spec.v_head_dim)  # [T, Hkv, Dv]
        out = ctx.backend.forward_rotary(q, k, v, cos, sin, spec, ctx.metadata, ctx.kv_cache(spec.layer_id))
        return None if out is None else out.flatten(1)  # [T, Hq * Dv]

    def forward_projected(
        self, x, linear: nn.Module, norm: nn.Module, residual, cos, sin, ctx: ForwardContext, out_weight=None
    ):
        """``(out [T, Hq * Dv], x + residual)`` of q/k/v projected from ``norm(x + residual)`` by
        ``linear``, rotated by ``cos, sin``, written and attended, where the backend does all of it in
        one launch before attending (``AttentionBackend.forward_projected``); ``None`` where it does not.
        With ``out_weight`` (the output projection's): ``out`` is projected by it ``[T, N]``, or ``None``
        where the backend does not do that too."""
        spec = self.spec
        done = ctx.backend.forward_projected(
            x, linear.weight, linear.bias, cos, sin, spec, ctx.metadata, ctx.kv_cache(spec.layer_id),
            norm_weight=norm.weight, eps=norm.eps, residual=residual, mode=norm.mode, out_weight=out_weight,
        )  # fmt: skip
        if done is None:
            return None
        out, summed = done
        return out.flatten(1), (x if residual is None else summed)


def local_heads(spec: AttentionSpec, num_heads: int, num_kv_heads: int) -> AttentionSpec:
    """``spec`` with this rank's head counts."""
    if (num_heads, num_kv_heads) == (spec.num_heads, spec.num_kv_heads):
        return spec
    if spec.sinks is not None:  # a tensor of every head: SelfAttention(sinks=True) makes this rank's
        raise ValueError(f"expected no attention sinks under tensor parallelism, got sinks on layer {spec.layer_id}")
    return dataclasses.replace(spec, num_heads=num_heads, num_kv_heads=num_kv_heads)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def window_left_of(config, layer_id: int) -> int:
    """Hugging Face ``sliding_window = S`` on ``sliding_attention`` layers is ``window_left = S - 1``."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None and layer_types[layer_id] == "sliding_attention" and window:
        return window - 1
    return -1


def attention_spec(config, layer_id: int, *, window_left: int | None = None) -> AttentionSpec:
    """The :class:`AttentionSpec` of a Llama-style decoder layer: the config's head counts and head dim
    (:func:`head_dim_of`), scale ``head_dim ** -0.5``, and the window of :func:`window_left_of` unless
    ``window_left`` is given (sinks: ``SelfAttention(sinks=True)``)."""
    head_dim = head_dim_of(config)
    return AttentionSpec(
        layer_id,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        scale=head_dim**-0.5,
        window_left=window_left_of(config, layer_id) if window_left is None else window_left,
    )


class SelfAttention(nn.Module):
    """``o_proj(attention(rotary(norm(q)), rotary(norm(k)), v))`` for one decoder layer.

    Checkpoint tensors ``q_proj``, ``k_proj``, ``v_proj`` load into ``qkv_proj`` (shards q, k, v).
    ``qk_norm_eps`` (Qwen3, Gemma 3): RMSNorm over each head of q and k before the rotary embedding.
    ``sinks=True`` (gpt-oss): a learned sink logit per query head, the parameter ``sinks`` (loaded from
    the checkpoint's ``self_attn.sinks``; this rank's heads under tensor parallelism).
    The attention rules (window, chunk, softcap, scale) are those of ``spec``, whose head counts are
    the model's; ``self.spec`` (what the engine and the cache see) has this rank's.
    """

    def __init__(
        self,
        hidden_size: int,
        spec: AttentionSpec,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_unit_offset: bool = False,
        sinks: bool = False,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.qkv_proj = QKVLinear(hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.v_head_dim, hidden_size, o_bias, tp=tp)
        full_heads = spec.num_heads
        spec = local_heads(spec, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads)
        if sinks:
            heads = spec.num_heads
            first = tp_or_single(tp).rank * heads  # a rank's query heads are one run

            def load_sinks(param: nn.Parameter, loaded) -> None:
                copy_checked(param.data, as_tensor(shard_of(loaded, [full_heads], 0, first, heads)))

            self.sinks = new_parameter(heads, loader=load_sinks)
            spec = dataclasses.replace(spec, sinks=self.sinks)
        self.spec = spec
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(spec.head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset)
            self.k_norm = RMSNorm(spec.head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset)
        self.attn = PagedAttention(spec)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        ctx: ForwardContext,
        rotary: nn.Module,
        table: tuple[torch.Tensor, torch.Tensor],
        *,
        norm: nn.Module | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``[T, H]``; ``table``: the rotary ``cos, sin`` of this forward's tokens
        (``rotary.table``), made once per forward by the model (:mod:`.decoder`).

        With ``norm`` (the layer's input RMSNorm) the input is ``norm(x + residual)`` and the return
        ``(out, x + residual)``: the norm runs inside the q/k/v projection where it can
        (:func:`~.linear.norm_then_linear`), and where the backend can, the rotation and the cache
        write run in that launch too (:meth:`PagedAttention.forward_projected`)."""
        if norm is None:  # (x: rows quantized by the norm already, FP8Rows, go straight to the vendor's matmul)
            qkv = self.qkv_proj(x) if isinstance(x, FP8Rows) else project(self.qkv_proj, x)
            return self.attend(positions, qkv, ctx, rotary, table)
        folds = norm_folds(self.qkv_proj, x, norm, residual) or row_norm_folds(self.qkv_proj, x, norm, residual)
        # (the backend's projecting launches take weights of the rows' dtype: not quantization="fp8"'s)
        if not hasattr(self, "q_norm") and folds is not None and self.qkv_proj.weight_scale is None:
            o_proj = self.o_proj
            if FOLD_OUT_PROJ and o_proj.bias is None and o_proj.tp.size == 1 and o_proj.weight.dtype == x.dtype:
                done = self.attn.forward_projected(x, self.qkv_proj, norm, residual, *table, ctx, o_proj.weight)
                if done is not None:  # and the split merge with the output projection in one launch
                    return done
            done = self.attn.forward_projected(x, self.qkv_proj, norm, residual, *table, ctx)
            if done is not None:  # the projection, rotation and cache write in one launch
                out, summed = done
                return project(self.o_proj, out), summed
        qkv, summed = norm_then_linear(self.qkv_proj, x, norm, residual)
        return self.attend(positions, qkv, ctx, rotary, table), summed

    def attend(self, positions, qkv: torch.Tensor, ctx: ForwardContext, rotary: nn.Module, table) -> torch.Tensor:
        """The layer after its q/k/v projection: ``qkv [T, (Hq + 2 Hkv) D]`` -> ``[T, H]``."""
        num_tokens, head_dim = qkv.shape[0], self.spec.head_dim
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(num_tokens, -1, head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, -1, head_dim)  # [T, Hkv, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = table
        if fused_ops(q) is not None:  # fused kernels on here: ask the backend to fuse rotary with its write
            out = self.attn.forward_rotary(q, k, v, cos, sin, ctx)
            if out is not None:
                return project(self.o_proj, out)
        q, k = rotary.apply(q, k, cos, sin)
        return project(self.o_proj, self.attn(q, k, v, ctx))
