"""Llama (``LlamaForCausalLM``): GQA attention with rotary embeddings (llama3 scaling included).

The decoder stack here is shared by the Llama-layout families: Qwen2 (q/k/v biases) and Qwen3 (q/k
RMSNorm) are configurations of it (:class:`LlamaForCausalLM` class attributes).
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.group import TPGroup
from ..runtime.context import ForwardContext
from .base import CausalLM
from .layers import (
    DecoderLayer,
    Embedding,
    GatedMLP,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    attention_spec,
    head_dim_of,
    run_decoder,
)


def self_attention(
    config, layer_id: int, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TPGroup | None = None
) -> SelfAttention:
    spec = attention_spec(config, layer_id)
    eps = config.rms_norm_eps if qk_norm else None
    return SelfAttention(config.hidden_size, spec, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm_eps=eps, tp=tp)


class LlamaDecoderLayer(DecoderLayer):
    """Attention, then the MLP (``mlp``: the config's gated MLP unless given, e.g. a mixture of experts)."""

    def __init__(self, config, self_attn: SelfAttention, tp: TPGroup | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = self_attn
        if mlp is None:
            bias = getattr(config, "mlp_bias", False)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias, tp=tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm; ``rotary`` is Llama's, or the caller's (e.g. mrope).
    ``attention(config, layer_id)`` builds each layer's attention and ``mlp(config, layer_id)``, when
    given, each layer's MLP (for the same ``tp``)."""

    def __init__(self, config, attention, rotary: nn.Module | None = None, tp: TPGroup | None = None, mlp=None):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention(config, i), tp, None if mlp is None else mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary if rotary is not None else RotaryEmbedding(config, head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.run(self.embed_tokens(input_ids), positions, ctx)

    def run(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The layers and final norm over input embeddings ``x [T, H]`` (positions as the rotary takes them)."""
        return run_decoder(self.layers, self.norm, positions, x, ctx, self.rotary_emb)


class LlamaForCausalLM(CausalLM):
    qkv_bias: bool | None = None  # None: the config's attention_bias (q, k, v and o alike)
    qk_norm = False
    supports_tensor_parallel = True

    def __init__(self, config, *, tp: TPGroup | None = None):
        super().__init__(config)
        self.tp = tp
        self.model = LlamaModel(config, self.make_attention, tp=tp, mlp=self.make_mlp)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tp=tp)

    def make_mlp(self, config, layer_id: int) -> nn.Module | None:
        """A layer's MLP; ``None``: the config's gated MLP."""
        return None

    def make_attention(self, config, layer_id: int) -> SelfAttention:
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if self.qkv_bias is None else self.qkv_bias
        o_bias = bias if self.qkv_bias is None else False
        return self_attention(config, layer_id, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=self.qk_norm, tp=self.tp)
