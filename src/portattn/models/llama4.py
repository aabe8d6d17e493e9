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
from torch import nn

from ..backends.base import AttentionSpec
from ..distributed.group import TPGroup, tp_or_single
from ..runtime.context import ForwardContext
from .base import CausalLM
from .layers import (
    DecoderLayer,
    Embedding,
    FusedMoE,
    GatedMLP,
    InterleavedRotaryEmbedding,
    Linear,
    LMHead,
    PagedAttention,
    QKVLinear,
    RMSNorm,
    RowParallelLinear,
    l2_norm,
    run_decoder,
)
from .layers.attention import local_heads
from .layers.fused import fused_ops
from .layers.linear import project

# On GPUs, 16-bit rope layers rotate q and k and norm them in one launch (fused_launch.rotary_pairs) where the
# torch code takes about twenty small kernels (False: the torch code; on an H200 the Llama 4-shaped batch-1 step was
# 1.48 ms without it and the experts' alternating rows, 1.39 with both: benchmarks/results/engine_h200/round18).
FUSED_ROTARY_PAIRS = True
# On GPUs, steps of a few 16-bit tokens route in one launch (fused_launch.router_topk: the logits, the top-k and the
# sigmoid, where the torch code takes six) and scale NoPE layers' queries by the attention temperature in one
# (fused_launch.attn_temperature, where it takes nine). False: the torch code.
FUSED_ROUTER = True


class Llama4Attention(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup | None = None):
        super().__init__()
        self.head_dim = head_dim = config.head_dim
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.use_rope = bool(config.no_rope_layers[layer_id])
        self.qk_norm_eps = config.rms_norm_eps if (config.use_qk_norm and self.use_rope) else None
        self.temperature = None
        if config.attn_temperature_tuning and not self.use_rope:
            self.temperature = (float(config.attn_scale), float(config.floor_scale))
        self.qkv_proj = QKVLinear(config.hidden_size, heads, kv_heads, head_dim, bias, tp=tp)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias, tp=tp)
        chunked = config.layer_types[layer_id] == "chunked_attention"
        spec = AttentionSpec(
            layer_id,
            heads,
            kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            attention_chunk_size=config.attention_chunk_size if chunked else None,
        )
        self.attn = PagedAttention(local_heads(spec, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext, rotary: InterleavedRotaryEmbedding, table
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(project(self.qkv_proj, x))
        q = q.view(num_tokens, -1, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, -1, self.head_dim)  # [T, Hkv, D]
        ops = fused_ops(q) if FUSED_ROTARY_PAIRS and q.dtype in (torch.float16, torch.bfloat16) else None
        if self.use_rope and ops is not None:  # the rotation and the q/k norm (on rope layers) in one launch
            q, k = ops.rotary_pairs(q, k, table, self.qk_norm_eps)
        elif self.use_rope:
            q, k = rotary.apply(q, k, table)
            if self.qk_norm_eps is not None:
                q, k = l2_norm(q, self.qk_norm_eps), l2_norm(k, self.qk_norm_eps)
        if self.temperature is not None:
            attn_scale, floor_scale = self.temperature
            ops = fused_ops(q) if FUSED_ROUTER and q.dtype in (torch.float16, torch.bfloat16) else None
            if ops is not None and positions.dim() == 1:
                q = ops.attn_temperature(q, positions, attn_scale, floor_scale)
            else:
                scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
                q = (q * scales[:, None, None]).to(q.dtype)
        return project(self.o_proj, self.attn(q, k, v, ctx))


class Llama4MoE(nn.Module):
    """Top-k sigmoid routing with a shared expert; an expert sees its tokens pre-scaled by their score.
    Under tensor parallelism the routed and shared experts' partial sums share one all-reduce."""

    def __init__(self, config, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp_or_single(tp)
        self.top_k = config.num_experts_per_tok
        self.experts = FusedMoE(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            weight_on_input=True,
            checkpoint_layout="stacked_in_out",
            tp=tp,
        )
        self.router = Linear(config.hidden_size, config.num_local_experts)
        self.router.quantizable = False  # its weight goes to router_topk as it is (fp8_linear)
        hidden, act = config.hidden_size, config.hidden_act
        self.shared_expert = GatedMLP(hidden, config.intermediate_size, act, tp=tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, top_ids = self.route(x)  # [T, k] each
        return self.tp.all_reduce(self.shared_expert(x) + self.experts(x, scores, top_ids))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [T, k]`` in x's dtype, ``expert ids [T, k])``: the top-k router logits' sigmoid."""
        ops = fused_ops(x) if FUSED_ROUTER else None
        weight = self.router.weight
        if (
            ops is not None
            and x.shape[0] <= ops.ROUTER_TOPK_TOKENS
            and weight.shape[0] <= ops.ROUTER_TOPK_EXPERTS
            and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype
            and self.router.bias is None
            and x.stride(-1) == weight.stride(-1) == 1
        ):
            return ops.router_topk(x, weight, self.top_k)
        top_logits, top_ids = torch.topk(self.router(x), self.top_k, dim=1)  # [T, k]
        return torch.sigmoid(top_logits.float()).to(x.dtype), top_ids


class Llama4DecoderLayer(DecoderLayer):
    """The pre-norm layer; its MLP (dense, or experts on ``moe_layers``) is ``feed_forward`` in checkpoints."""

    def __init__(self, config, layer_id: int, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = Llama4Attention(config, layer_id, tp)
        if layer_id in config.moe_layers:
            self.mlp = Llama4MoE(config, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size_mlp, config.hidden_act, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama4TextModel(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(Llama4DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = InterleavedRotaryEmbedding(config, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return run_decoder(self.layers, self.norm, positions, self.embed_tokens(input_ids), ctx, self.rotary_emb)


class Llama4ForCausalLM(CausalLM):
    """Text-only Llama 4; also loads ``Llama4ForConditionalGeneration`` checkpoints (vision skipped)."""

    supports_tensor_parallel = True

    def __init__(self, config, *, tp: TPGroup | None = None):
        config = getattr(config, "text_config", None) or config
        super().__init__(config)
        self.model = Llama4TextModel(config, tp)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tp=tp)

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith(("vision_model.", "multi_modal_projector.")):
            return None
        return super().checkpoint_name(name.removeprefix("language_model.").replace(".feed_forward.", ".mlp."))
