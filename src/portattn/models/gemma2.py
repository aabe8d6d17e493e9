"""Gemma 2 (``Gemma2ForCausalLM``), as transformers' ``modeling_gemma2`` computes it.

* Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (not the head dim) and capped at
  ``attn_logit_softcapping`` (``c * tanh(s / c)``, before the mask); ``sliding_attention`` layers
  (every other one, from the first) see the last ``sliding_window`` tokens, the others everything.
* Each decoder layer norms before and after both attention and the MLP (four RMSNorms of the
  ``(1 + w)`` kind); the MLP is gated with ``hidden_activation`` (GeLU-tanh).
* Embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype); the final logits
  are capped at ``final_logit_softcapping``.

Gemma 3's text model (:mod:`.gemma3`) is a configuration of these classes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends.base import AttentionSpec
from ..distributed.group import TPGroup
from ..errors import expect
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
    head_dim_of,
    window_left_of,
)


def check_config(config) -> None:
    """Reject configs this model would compute differently from transformers."""
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    expect(not bidirectional, "causal attention (use_bidirectional_attention false)", bidirectional)
    layer_types = list(getattr(config, "layer_types", None) or [])
    expect(len(layer_types) == config.num_hidden_layers, f"{config.num_hidden_layers} layer_types", layer_types)
    kinds = set(layer_types) - {"sliding_attention", "full_attention"}
    expect(not kinds, "layer_types of sliding_attention and full_attention", sorted(kinds))


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``; ``x`` unchanged when ``cap`` is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


class Gemma2DecoderLayer(DecoderLayer):
    """Norms before and after both blocks: the stream gets ``post_attention_layernorm(attention)``
    and ``post_feedforward_layernorm(mlp)``."""

    def __init__(self, config, self_attn: SelfAttention, tp: TPGroup | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation, tp=tp)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def forward(self, positions, x, ctx, rotary, table, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.add_norm(self.input_layernorm, x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, ctx, rotary, table))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2Model(nn.Module):
    """Scaled embeddings, decoder layers, final norm; one rotary embedding per layer type (they differ
    when ``rope_parameters`` is given per layer type, as Gemma 3's is)."""

    def __init__(self, config, attention, tp: TPGroup | None = None):
        super().__init__()
        # sqrt(hidden) in float32, rounded to the model dtype when used (as transformers rounds it)
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5, dtype=torch.float32), persistent=False)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, attention(config, i), tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.layer_types = list(config.layer_types)
        per_type = getattr(config, "rope_parameters", None) or {}
        self.rotary_emb = nn.ModuleDict(
            {
                kind: RotaryEmbedding(config, head_dim_of(config), layer_type=kind if kind in per_type else None)
                for kind in sorted(set(self.layer_types))
            }
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        x = x * self.normalizer.to(x.dtype)
        tables = {kind: rotary.table(positions, x.dtype) for kind, rotary in self.rotary_emb.items()}
        residual = None
        for layer, kind in zip(self.layers, self.layer_types):
            x, residual = layer(positions, x, ctx, self.rotary_emb[kind], tables[kind], residual)
        return self.norm(x, residual)[0]


class Gemma2ForCausalLM(CausalLM):
    qk_norm = False  # Gemma 3: (1 + w) RMSNorm over each q and k head
    attention_softcap = True  # Gemma 3's attention ignores attn_logit_softcapping, as transformers' does

    supports_tensor_parallel = True

    def __init__(self, config, *, tp: TPGroup | None = None):
        check_config(config)
        super().__init__(config)
        self.tp = tp
        self.model = Gemma2Model(config, self.make_attention, tp=tp)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tp=tp)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def make_attention(self, config, layer_id: int) -> SelfAttention:
        cap = getattr(config, "attn_logit_softcapping", None) if self.attention_softcap else None
        spec = AttentionSpec(
            layer_id,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim_of(config),
            scale=config.query_pre_attn_scalar**-0.5,
            window_left=window_left_of(config, layer_id),
            logit_softcap=cap or 0.0,
        )
        bias = bool(getattr(config, "attention_bias", False))
        eps = config.rms_norm_eps if self.qk_norm else None
        return SelfAttention(
            config.hidden_size, spec, qkv_bias=bias, o_bias=bias, qk_norm_eps=eps, qk_norm_unit_offset=True, tp=self.tp
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden), self.final_logit_softcapping)  # [N, V]
