"""Llama (``LlamaForCausalLM``): GQA attention with rotary embeddings (llama3 scaling included)."""

from __future__ import annotations

import torch
from torch import nn

from ..backends.base import AttentionLayer
from .layers import CausalLM, ForwardContext, GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def window_left_of(config, layer_id: int) -> int:
    """Hugging Face ``sliding_window = S`` on ``sliding_attention`` layers is ``window_left = S - 1``."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None and layer_types[layer_id] == "sliding_attention" and window:
        return window - 1
    return -1


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, qk_norm: bool = False):
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=bias)
        if qk_norm:  # Qwen3: RMSNorm over each head, before the rotary embedding
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        spec = AttentionLayer(
            layer_id, heads, kv_heads, head_dim, scale=head_dim**-0.5, window_left=window_left_of(config, layer_id)
        )
        self.attn = PagedAttention(spec)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, -1, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, -1, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x)  # [T, Hkv * D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, qk_norm: bool = False):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qk_norm)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, ctx, rotary) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, qk_norm: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, qk_norm) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        for layer in self.layers:
            x = layer(positions, x, ctx, self.rotary_emb)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    qk_norm = False

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config, qk_norm=self.qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
