"""Mixtral (``MixtralForCausalLM``): Mistral's attention (a sliding window on every layer when
``sliding_window`` is set) with a mixture of experts in place of every MLP, as transformers'
``modeling_mixtral`` computes it.

The router (``block_sparse_moe.gate``) takes a softmax over the ``num_local_experts`` logits in
float32 and keeps the ``num_experts_per_tok`` largest probabilities, renormalised to sum 1 and kept in
float32; each expert is a gated MLP whose checkpoint tensors are ``w1`` (gate), ``w3`` (up) and ``w2``
(down).
"""

from __future__ import annotations

import re

from torch import nn

from ..distributed.group import TPGroup
from .layers import SoftmaxTopKMoE, per_expert_checkpoint_name
from .mistral import MistralForCausalLM

_MIXTRAL_EXPERT = re.compile(r"(.*\.)block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class MixtralForCausalLM(MistralForCausalLM):
    def __init__(self, config, *, tp: TPGroup | None = None):
        super().__init__(config, tp=tp)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return SoftmaxTopKMoE(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            config.hidden_act,
            normalize=True,
            weights_in_float32=True,
            tp=self.tp,
        )

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        expert = _MIXTRAL_EXPERT.match(name)
        if expert:  # experts.{e}.w1/w3/w2 -> the stacked experts' gate/up and down shards
            prefix, index, weight = expert.groups()
            return per_expert_checkpoint_name(f"{prefix}mlp.experts.{index}.{_PROJECTIONS[weight]}.weight")
        return super().checkpoint_name(name.replace(".block_sparse_moe.", ".mlp."))
