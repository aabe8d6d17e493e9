"""Llama 4 text model (``Llama4ForCausalLM``; the text part of ``Llama4ForConditionalGeneration``).

Per layer, as transformers' ``Llama4TextModel`` does it:

* RoPE layers (``no_rope_layers[i] == 1``) rotate q/k with complex (interleaved-pair) rotary
  embeddings, then L2-normalise them (``use_qk_norm``), and attend in absolute chunks of
  ``attention_chunk_size`` (``layer_types[i] == "chunked_attention"``);
* NoPE layers attend over the whole context and scale queries by the attention temperature
  ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` (``attn_temperature_tuning``);
* MoE layers (``moe_layers``) route each token to its top-k experts with sigmoid scores applied to
  the expert *input*, plus a shared expert; the other layers are dense MLPs of
  ``intermediate_size_mlp``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.base import AttentionLayer
from .layers import CausalLM, ForwardContext, GatedMLP, PagedAttention, RMSNorm, rope_inv_freq


class Llama4Rotary(nn.Module):
    """Rotary embedding on consecutive pairs ``(x[2i], x[2i+1])``, in complex float32 as transformers does."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * self.scaling  # [T, D / 2] complex
        return _rotate(q, freqs_cis), _rotate(k, freqs_cis)


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [T, H, D / 2] complex
    return torch.view_as_real(pairs * freqs_cis[:, None, :]).flatten(2).type_as(x)  # [T, H, D]


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.head_dim = head_dim = config.head_dim
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.use_rope = bool(config.no_rope_layers[layer_id])
        self.qk_norm_eps = config.rms_norm_eps if (config.use_qk_norm and self.use_rope) else None
        self.temperature = None
        if config.attn_temperature_tuning and not self.use_rope:
            self.temperature = (float(config.attn_scale), float(config.floor_scale))
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=bias)
        chunked = config.layer_types[layer_id] == "chunked_attention"
        spec = AttentionLayer(
            layer_id,
            heads,
            kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            attention_chunk_size=config.attention_chunk_size if chunked else None,
        )
        self.attn = PagedAttention(spec)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext, rotary: Llama4Rotary):
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, -1, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, -1, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x)  # [T, Hkv * D]
        if self.use_rope:
            q, k = rotary(positions, q, k)
        if self.qk_norm_eps is not None:
            q, k = _l2_norm(q, self.qk_norm_eps), _l2_norm(k, self.qk_norm_eps)
        if self.temperature is not None:
            attn_scale, floor_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
            q = (q * scales[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, ctx))


class Llama4Experts(nn.Module):
    def __init__(self, config):
        super().__init__()
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
        return (up * F.silu(gate)) @ self.down_proj[e]  # [n, H]


class Llama4MoE(nn.Module):
    """Top-k sigmoid routing with a shared expert; an expert sees its tokens pre-scaled by their score."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.experts = Llama4Experts(config)
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.shared_expert = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, top_ids = torch.topk(self.router(x), self.top_k, dim=1)  # [T, k]
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)  # [T, k]
        out = self.shared_expert(x)
        # One host sync per MoE layer (the per-expert token lists); experts nobody chose cost nothing.
        flat_ids = top_ids.flatten()  # [T * k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.experts.gate_up_proj.shape[0]).tolist()
        tokens = order // self.top_k
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = tokens[start : start + n]
                routed = x[idx] * scores.flatten()[order[start : start + n], None]  # [n, H]
                out.index_add_(0, idx, self.experts.expert(e, routed))
            start += n
        return out


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = Llama4Attention(config, layer_id)
        if layer_id in config.moe_layers:
            self.feed_forward = Llama4MoE(config)
        else:
            self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size_mlp, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, ctx, rotary) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx, rotary)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class Llama4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Llama4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Llama4Rotary(config, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        for layer in self.layers:
            x = layer(positions, x, ctx, self.rotary_emb)
        return self.norm(x)


class Llama4ForCausalLM(CausalLM):
    """Text-only Llama 4; also loads ``Llama4ForConditionalGeneration`` checkpoints (vision skipped)."""

    def __init__(self, config):
        config = getattr(config, "text_config", None) or config
        super().__init__(config)
        self.model = Llama4TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(("vision_model.", "multi_modal_projector.")):
            return None
        return super().checkpoint_name(name.removeprefix("language_model."))
