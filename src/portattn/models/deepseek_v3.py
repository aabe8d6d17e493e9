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
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.group import TPGroup, tp_or_single
from ..errors import expect
from ..runtime.context import ForwardContext
from ..runtime.kv_cache import KVCacheSpec, mla_cache_spec
from .base import PACKED_MODULES, CausalLM
from .layers import (
    DecoderLayer,
    Embedding,
    FusedMoE,
    GatedMLP,
    LMHead,
    MultiheadLatentAttention,
    PartialRotaryEmbedding,
    RMSNorm,
    new_parameter,
    per_expert_checkpoint_name,
    run_decoder,
)
from .layers.fused import fused_ops

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


# On GPUs the router's grouped top-k after its logits runs in one launch (fused_launch.grouped_topk) where the
# torch code takes about fourteen (False: the torch code).
FUSED_ROUTER = True


class DeepseekV3Router(nn.Module):
    """Grouped top-k routing in float32 (``mlp.gate`` in checkpoints)."""

    def __init__(self, config):
        super().__init__()
        experts = config.n_routed_experts
        self.top_k, self.num_groups, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        # float32 in any model dtype, as transformers keeps them
        self.weight = new_parameter(experts, config.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = new_parameter(experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> ``(weights [T, k] float32, expert ids [T, k])``."""
        ops = fused_ops(x) if FUSED_ROUTER else None
        if ops is not None:  # the routing after the logits in one launch
            return ops.grouped_topk(
                F.linear(x.float(), self.weight.float()), self.e_score_correction_bias.float(), top_k=self.top_k,
                num_groups=self.num_groups, topk_group=self.topk_group, normalize=self.norm_topk_prob,
                scaling=self.routed_scaling_factor,
            )  # fmt: skip
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
    """Routed experts plus shared experts; under tensor parallelism one all-reduce for both."""

    def __init__(self, config, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp_or_single(tp)
        inter, act, hidden = config.moe_intermediate_size, config.hidden_act, config.hidden_size
        self.gate = DeepseekV3Router(config)
        self.experts = FusedMoE(config.n_routed_experts, hidden, inter, act, checkpoint_layout="per_expert", tp=tp)
        self.shared_experts = GatedMLP(hidden, inter * config.n_shared_experts, act, tp=tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] each
        return self.tp.all_reduce(self.experts(x, weights, ids) + self.shared_experts(x))


class DeepseekV3DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_id: int, scale: float, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = MultiheadLatentAttention(config, layer_id, scale, tp=tp)
        if layer_id >= config.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(config, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3Model(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None):
        super().__init__()
        scale = softmax_scale(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp=tp)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i, scale, tp) for i in layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        interleave = bool(getattr(config, "rope_interleave", True))
        self.rotary_emb = PartialRotaryEmbedding(config, config.qk_rope_head_dim, interleave=interleave)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return run_decoder(self.layers, self.norm, positions, self.embed_tokens(input_ids), ctx, self.rotary_emb)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek V3 text model; the multi-token-prediction layers some checkpoints carry
    (``model.layers.{num_hidden_layers}..``) are skipped, as transformers skips them."""

    attention_ops = ("varlen_attention", "mla_decode")  # expanded prefill, absorbed decode
    # MLA's q_proj (no q LoRA) is its own module, not part of a merged q/k/v projection.
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = {
        name: PACKED_MODULES[name] for name in ("gate_proj", "up_proj")
    }

    supports_tensor_parallel = True

    def __init__(self, config, *, tp: TPGroup | None = None):
        check_config(config)
        super().__init__(config)
        self.model = DeepseekV3Model(config, tp)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tp=tp)

    def attention_specs(self):
        return [layer.self_attn.spec for layer in self.model.layers]

    def kv_cache_spec(self) -> KVCacheSpec:
        config = self.config
        return mla_cache_spec(config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim)

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None
        return per_expert_checkpoint_name(name) or super().checkpoint_name(name)
