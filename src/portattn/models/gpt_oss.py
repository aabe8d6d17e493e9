"""gpt-oss (``GptOssForCausalLM``), as transformers' ``modeling_gpt_oss`` computes it.

* Attention: q/k/v/o with biases, rotary embeddings (YaRN in the released models), and one learned
  sink logit per query head (``self_attn.sinks``) that joins the softmax denominator and carries no
  value. ``sliding_attention`` layers (every other one, from the first) see the last
  ``sliding_window`` (128) tokens, the others everything. Head dim 64.
* Every layer's MLP is a mixture of experts: a biased router picks the top ``num_experts_per_tok``
  experts and weighs them by a softmax over the picked logits only; each expert is a biased
  ``gate_up`` projection with interleaved gate and up columns, the clamped SwiGLU
  (:class:`~portattn.models.layers.ClampedSwiGLU`, ``swiglu_alpha``, ``swiglu_limit``) and a biased
  down projection.
* Checkpoints whose experts are MXFP4-quantized (``quantization_config.quant_method == "mxfp4"``:
  ``gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales``) are dequantized at
  load time into the model's dtype (:mod:`.layers.quant`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..distributed.group import TPGroup, tp_or_single
from ..errors import expect
from ..runtime.context import ForwardContext
from .base import CausalLM
from .layers import (
    ClampedSwiGLU,
    DecoderLayer,
    Embedding,
    FusedMoE,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    attention_spec,
    head_dim_of,
    run_decoder,
)

QUANT_METHODS = ("mxfp4",)


def expert_checkpoint_layout(config) -> str:
    """``"stacked_in_out"`` for unquantized experts, ``"mxfp4"`` for MXFP4 ones; other quantizations are refused."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return "stacked_in_out"
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    expect(method in QUANT_METHODS, f"unquantized experts or quant_method in {list(QUANT_METHODS)}", repr(method))
    return "mxfp4"


def check_config(config) -> None:
    layer_types = list(getattr(config, "layer_types", None) or [])
    expect(len(layer_types) == config.num_hidden_layers, f"{config.num_hidden_layers} layer_types", layer_types)
    kinds = set(layer_types) - {"sliding_attention", "full_attention"}
    expect(not kinds, "layer_types of sliding_attention and full_attention", sorted(kinds))
    top_k, experts = config.num_experts_per_tok, config.num_local_experts
    expect(1 <= top_k <= experts, f"num_experts_per_tok in [1, num_local_experts {experts}]", top_k)
    expert_checkpoint_layout(config)


def gpt_oss_attention(config, layer_id: int, tp: TPGroup | None = None) -> SelfAttention:
    """:class:`SelfAttention` with biases and the layer's learned sinks (``self_attn.sinks``, one per
    query head; the backend reads them through the layer's :class:`AttentionSpec`)."""
    bias = bool(config.attention_bias)
    spec = attention_spec(config, layer_id)
    return SelfAttention(config.hidden_size, spec, qkv_bias=bias, o_bias=bias, sinks=True, tp=tp)


def swiglu_parameters(config) -> tuple[float, float]:
    """``(alpha, limit)`` of the clamped SwiGLU: the config's, else gpt-oss's published 1.702 and 7.0
    (configs of transformers before 5.2x do not carry ``swiglu_alpha``; its modeling code fixed it)."""
    return float(getattr(config, "swiglu_alpha", 1.702)), float(getattr(config, "swiglu_limit", 7.0))


class GptOssMLP(nn.Module):
    """Softmax over the top-k router logits; biased experts with the clamped SwiGLU."""

    def __init__(self, config, tp: TPGroup | None = None):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.tp = tp_or_single(tp)
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=True)  # replicated
        self.router.quantizable = False  # the model's dtype (fp8_linear)
        self.experts = FusedMoE(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            checkpoint_layout=expert_checkpoint_layout(config),
            bias=True,
            gate_up_act=ClampedSwiGLU(*swiglu_parameters(config)),
            gate_up_interleaved=True,
            tp=tp,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, top_ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_logits, dim=1, dtype=top_logits.dtype)  # [T, k]
        return self.tp.all_reduce(self.experts(x, weights, top_ids))


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_id: int, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = gpt_oss_attention(config, layer_id, tp)
        self.mlp = GptOssMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_in_float32=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_in_float32=True)


class GptOssModel(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_in_float32=True)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return run_decoder(self.layers, self.norm, positions, self.embed_tokens(input_ids), ctx, self.rotary_emb)


_MXFP4_PART = re.compile(r"(.*\.mlp\.experts\.(?:gate_up|down)_proj)_(blocks|scales)$")


class GptOssForCausalLM(CausalLM):
    supports_tensor_parallel = True
    quant_methods = QUANT_METHODS

    def __init__(self, config, *, tp: TPGroup | None = None):
        check_config(config)
        super().__init__(config)
        self.model = GptOssModel(config, tp)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tp=tp)

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        quantized = _MXFP4_PART.match(name)
        if quantized:  # one half of an MXFP4 expert matrix
            param, part = quantized.groups()
            return param, part
        return super().checkpoint_name(name)
