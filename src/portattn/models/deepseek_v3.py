"""DeepSeek V3 (``DeepseekV3ForCausalLM``), as transformers' ``modeling_deepseek_v3`` computes it.

* Attention is Multi-head Latent Attention (:mod:`.latent_attention`): queries through a low-rank
  ``q_a_proj -> q_a_layernorm -> q_b_proj`` (or one ``q_proj`` when ``q_lora_rank`` is None), keys
  and values from a cached latent ``[c_kv | k_pe]`` (``kv_a_proj_with_mqa``, ``kv_a_layernorm``)
  expanded by ``kv_b_proj``. Only ``qk_rope_head_dim`` dims of each head carry the rotary
  embedding (decoupled rope), on interleaved pairs when ``rope_interleave``; the softmax scale is
  ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling.
* The first ``first_k_dense_replace`` layers have a dense MLP; the others a mixture of experts:
  sigmoid scores plus ``e_score_correction_bias`` choose ``topk_group`` of ``n_group`` expert
  groups (a group scores the sum of its two best), then the top ``num_experts_per_tok`` experts in
  them; the weights are the uncorrected scores, renormalised when ``norm_topk_prob``, times
  ``routed_scaling_factor``; shared experts see every token.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.kv_pool import KVCacheSpec
from ..engine.mla_pool import mla_cache_spec
from ..errors import expect
from .latent_attention import MultiheadLatentAttention, plan_latent_attention
from .layers import CausalLM, ForwardContext, GatedMLP, RMSNorm, rope_inv_freq

# Routing methods and scoring functions of the original DeepSeek configs that this model computes.
TOPK_METHODS = ("noaux_tc",)
SCORING_FUNCS = ("sigmoid",)


def check_config(config) -> None:
    """Reject configs this model would compute differently from transformers."""
    method = getattr(config, "topk_method", "noaux_tc")
    expect(method in TOPK_METHODS, f"topk_method in {list(TOPK_METHODS)}", repr(method))
    scoring = getattr(config, "scoring_func", "sigmoid")
    expect(scoring in SCORING_FUNCS, f"scoring_func in {list(SCORING_FUNCS)}", repr(scoring))
    rope_dim = config.qk_rope_head_dim
    expect(rope_dim % 2 == 0, "an even qk_rope_head_dim", rope_dim)
    if config.first_k_dense_replace >= config.num_hidden_layers:
        return  # no MoE layer
    experts, groups = config.n_routed_experts, config.n_group
    ok = isinstance(groups, int) and groups >= 1 and experts % groups == 0
    expect(ok, f"n_group dividing n_routed_experts {experts}", groups)
    per_group = experts // groups
    expect(per_group >= 2, "at least 2 experts per group (a group scores its two best)", per_group)
    expect(1 <= config.topk_group <= groups, f"topk_group in [1, n_group {groups}]", config.topk_group)
    most = config.topk_group * per_group
    expect(1 <= config.num_experts_per_tok <= most, f"num_experts_per_tok in [1, {most}]", config.num_experts_per_tok)


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` when a scaled rope sets ``mscale_all_dim``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale = scale * mscale * mscale
    return scale


class DeepseekRotary(nn.Module):
    """Rotary embedding of the ``qk_rope_head_dim`` dims; interleaved pairs ``(x[2i], x[2i+1])``
    when ``rope_interleave`` (written back as ``[rotated evens | rotated odds]``, as transformers
    does), rotate-half otherwise."""

    def __init__(self, config):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, config.qk_rope_head_dim)
        expect(2 * inv_freq.shape[0] == config.qk_rope_head_dim, f"rotary frequencies for all "
                f"{config.qk_rope_head_dim} rope dims", 2 * inv_freq.shape[0])  # fmt: skip
        self.interleave = bool(getattr(config, "rope_interleave", True))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, Dr / 2]`` (interleaved) or ``[T, Dr]`` (rotate-half), in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, Dr / 2]
        emb = freqs if self.interleave else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, H, Dr]`` rotated by ``cos, sin`` of :meth:`forward`."""
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, *]
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, Dr / 2] each
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DeepseekV3Router(nn.Module):
    """Grouped top-k routing in float32 (``mlp.gate`` in checkpoints)."""

    def __init__(self, config):
        super().__init__()
        experts = config.n_routed_experts
        self.top_k, self.num_groups, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> ``(weights [T, k] float32, expert ids [T, k])``."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(x.shape[0], self.num_groups, -1)  # [T, G, E / G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # [T, G]
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape_as(choice), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class DeepseekV3MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        inter, act = config.moe_intermediate_size, config.hidden_act
        self.gate = DeepseekV3Router(config)
        self.experts = nn.ModuleList(GatedMLP(config.hidden_size, inter, act) for _ in range(config.n_routed_experts))
        self.shared_experts = GatedMLP(config.hidden_size, inter * config.n_shared_experts, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] each
        routed = torch.zeros_like(x)
        # One host sync per MoE layer (the per-expert token lists); experts nobody chose cost nothing.
        flat = ids.flatten()  # [T * k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                picks = order[start : start + n]  # [n] indices into [T * k]
                tokens = picks // ids.shape[1]
                out = self.experts[e](x[tokens]) * weights.flatten()[picks, None]  # [n, hidden] float32
                routed.index_add_(0, tokens, out.to(x.dtype))
            start += n
        return routed + self.shared_experts(x)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, scale: float):
        super().__init__()
        self.self_attn = MultiheadLatentAttention(config, layer_id, scale)
        if layer_id >= config.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, rotary, ctx, plan) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, rotary, ctx, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        scale = softmax_scale(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i, scale) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DeepseekRotary(config)
        self.num_heads, self.kv_lora_rank = config.num_attention_heads, config.kv_lora_rank

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        plan = plan_latent_attention(ctx, self.num_heads, self.kv_lora_rank)  # once per forward, for all layers
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, self.rotary_emb, ctx, plan)
        return self.norm(x)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek V3 text model; the multi-token-prediction layers some checkpoints carry
    (``model.layers.{num_hidden_layers}..``) are skipped, as transformers skips them."""

    attention_ops = ("varlen_attention", "mla_decode")  # expanded prefill, absorbed decode

    def __init__(self, config):
        check_config(config)
        super().__init__(config)
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def float32_weights(self) -> frozenset[str]:
        """Router weights, kept in float32 in any dtype (as transformers keeps them)."""
        names = (name for name, _ in self.named_parameters())
        return frozenset(n for n in names if n.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")))

    def attention_layers(self):
        return [layer.self_attn.spec for layer in self.model.layers]

    def kv_cache_spec(self) -> KVCacheSpec:
        config = self.config
        return mla_cache_spec(config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim)

    def checkpoint_name(self, name: str) -> str | None:
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None
        return super().checkpoint_name(name)
