"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (biases on q, k and v as ``qkv_bias`` says;
sliding-window layers as ``layer_types`` lists them) with a mixture of experts in place of the MLP, as
transformers' ``modeling_qwen2_moe`` computes it.

* Layer ``i`` has the experts when it is not in ``mlp_only_layers`` and ``(i + 1) %
  decoder_sparse_step == 0``; the other layers have a dense gated MLP of ``intermediate_size``.
* The routed experts are Qwen3-MoE's (softmax over all logits, top ``num_experts_per_tok``,
  renormalised when ``norm_topk_prob``); a shared expert (``shared_expert_intermediate_size``) runs on
  every token, scaled by ``sigmoid(shared_expert_gate(x))``, and is added to their sum.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.group import TPGroup
from .layers import GatedMLP, Linear, SelfAttention, SoftmaxTopKMoE, per_expert_checkpoint_name
from .llama import self_attention
from .qwen2 import Qwen2ForCausalLM
from .qwen3_moe import check_config, is_sparse_layer, routed_experts_arguments


class Qwen2MoeSparseMoe(SoftmaxTopKMoE):
    """Routed experts plus the gated shared expert; under tensor parallelism one all-reduce for both."""

    def __init__(self, config, tp: TPGroup | None = None):
        super().__init__(**routed_experts_arguments(config), tp=tp)
        hidden, act = config.hidden_size, config.hidden_act
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size, act, tp=tp, reduce=False)
        self.shared_expert_gate = Linear(hidden, 1)  # replicated
        self.shared_expert_gate.quantizable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(self.routed(x) + shared)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def __init__(self, config, *, tp: TPGroup | None = None):
        check_config(config)
        super().__init__(config, tp=tp)

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        return per_expert_checkpoint_name(name) or super().checkpoint_name(name)

    def make_attention(self, config, layer_id: int) -> SelfAttention:
        bias = bool(getattr(config, "qkv_bias", True))
        return self_attention(config, layer_id, qkv_bias=bias, o_bias=False, qk_norm=False, tp=self.tp)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return Qwen2MoeSparseMoe(config, self.tp)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=self.tp)
