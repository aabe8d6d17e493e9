"""The decoder layer every family's follows: one signature, one return convention.

``layer(positions, x, ctx, rotary, table, residual=None) -> (h, residual)``

* ``positions [T]`` (``[3, T]`` under multimodal rotary): the new tokens' positions;
* ``x [T, H]``: the previous layer's ``h``, or the embeddings for the first layer;
* ``ctx``: the forward's :class:`~portattn.runtime.context.ForwardContext`;
* ``rotary``: the layer's rotary embedding module, and ``table`` what its ``table(positions, dtype)``
  returned: made once per forward by the model and shared by every layer that uses that module;
* ``residual``: the residual stream ``x`` is to be added to; ``None`` for the first layer, whose
  ``x`` is the stream itself;
* returns ``h``, the output of the layer's last block, and the residual stream before it (the
  stream after the layer is ``h + residual``). The next layer adds the two in its first norm's fused
  add + norm (:class:`~portattn.models.layers.norm.RMSNorm` ``(x, residual)``, whose sum rounds as a
  separate add would), and the model ends with ``norm(h, residual)[0]`` (:func:`run_decoder` runs the layers so).

A layer's attention module takes ``(positions, x, ctx, rotary, table)`` and returns ``[T, H]``. The
shared blocks also take the norm before them (``SelfAttention(..., norm=, residual=)``,
``GatedMLP(h, norm=, residual=)``, returning ``(out, x + residual)``): at small batches on GPUs
:class:`DecoderLayer` hands them its norms to run inside their first projection (:mod:`.fused`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from ...runtime.context import ForwardContext
from .activation import Activation
from .fp8_linear import FP8Rows
from .fused import fused_linear_ops, fused_ops
from .linear import Linear, _fp8_tile_ops


class DecoderLayer(nn.Module):
    """The pre-norm layer (Llama and most families): ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``, each block added to the residual stream. Subclasses build
    the four modules (their names are the checkpoints'); a family with other norms overrides
    :meth:`forward` under the same signature."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        ctx: ForwardContext,
        rotary: nn.Module,
        table,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fuse_attention, fuse_mlp = self.norm_fusion if fused_linear_ops(x) is not None else (False, False)
        if fuse_attention:  # the norm inside the q/k/v projection (small batches on GPUs)
            h, residual = self.self_attn(positions, x, ctx, rotary, table, norm=self.input_layernorm, residual=residual)
        else:
            quantize = self.quantized_norms[0] and quantizes_in_norm(x, self.self_attn.qkv_proj)
            h, residual = self.add_norm(self.input_layernorm, x, residual, quantize)
            h = self.self_attn(positions, h, ctx, rotary, table)
        if fuse_mlp:  # the norm and the activation inside the gate/up projection
            return self.mlp(h, norm=self.post_attention_layernorm, residual=residual)
        if self.quantized_norms[1] and quantizes_in_norm(h, self.mlp.gate_up_proj):
            h, residual = self.post_attention_layernorm.quantized(h, residual)
        else:
            h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    @functools.cached_property
    def norm_fusion(self) -> tuple[bool, bool]:
        """Whether the input norm can run inside the attention's q/k/v projection and the post-attention
        norm inside the MLP's gate/up projection: the shared blocks, not overridden (a family's own
        attention or MLP, a mixture of experts, keeps its norms apart)."""
        from .attention import SelfAttention
        from .mlp import GatedMLP
        from .norm import RMSNorm

        def plain(module, cls) -> bool:
            return isinstance(module, cls) and type(module).forward is cls.forward

        attention = plain(self.self_attn, SelfAttention) and plain(self.input_layernorm, RMSNorm)
        mlp = plain(self.mlp, GatedMLP) and plain(self.post_attention_layernorm, RMSNorm)
        return attention, mlp and isinstance(self.mlp.act, Activation)

    @functools.cached_property
    def quantized_norms(self) -> tuple[bool, bool]:
        """Whether the input norm and the post-attention norm can quantize their rows for the projection after
        them (``quantization="fp8"``: :meth:`RMSNorm.quantized`): an RMSNorm before the shared attention block
        (its fp8 q/k/v projection) and before the shared MLP (its fp8 gate/up projection), neither overridden."""
        from .attention import SelfAttention
        from .mlp import GatedMLP
        from .norm import RMSNorm

        def plain(module, cls) -> bool:
            return isinstance(module, cls) and type(module).forward is cls.forward

        def fp8(projection) -> bool:
            return getattr(projection, "weight_scale", None) is not None and type(projection).forward is Linear.forward

        attention = plain(self.self_attn, SelfAttention) and plain(self.input_layernorm, RMSNorm)
        mlp = plain(self.mlp, GatedMLP) and plain(self.post_attention_layernorm, RMSNorm)
        return attention and fp8(self.self_attn.qkv_proj), mlp and fp8(self.mlp.gate_up_proj)

    @staticmethod
    def add_norm(
        norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, quantize: bool = False
    ) -> tuple[torch.Tensor | FP8Rows, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with ``residual`` None, ``x`` is the stream. ``quantize``: the
        normed rows quantized for an fp8 projection (:meth:`RMSNorm.quantized`)."""
        if quantize:
            return norm.quantized(x, residual)
        if residual is None:
            return norm(x), x
        return norm(x, residual)


# quantization="fp8" on GPUs: the norms before the q/k/v and gate/up projections quantize their rows in their own
# launch (True), or write them in the model dtype and the projection quantizes them (False; the benchmarks'
# --kernel-options unfused_fp8_norm).
QUANTIZE_IN_NORM = True


def quantizes_in_norm(x: torch.Tensor, projection: Linear) -> bool:
    """Whether a norm over ``x [T, H]`` quantizes its rows for the fp8 ``projection`` after it (where
    :attr:`DecoderLayer.quantized_norms` says it can): on a GPU, more than one row, none that the projection
    takes in the fused small-batch launches, ``QUANTIZE_IN_NORM`` on."""
    return (
        QUANTIZE_IN_NORM
        and x.dim() == 2
        and x.shape[0] > 1
        and fused_ops(x) is not None
        and _fp8_tile_ops(projection, x) is None
    )


def run_decoder(
    layers: Sequence[nn.Module],
    norm: nn.Module,
    positions: torch.Tensor,
    x: torch.Tensor,
    ctx: ForwardContext,
    rotary: nn.Module,
) -> torch.Tensor:
    """The decoder layers over ``x [T, H]`` with one rotary embedding (its table made here, once),
    then the final ``norm`` of the stream -> ``[T, H]``."""
    table, residual = rotary.table(positions, x.dtype), None
    for layer in layers:
        x, residual = layer(positions, x, ctx, rotary, table, residual)
    return norm(x, residual)[0]
