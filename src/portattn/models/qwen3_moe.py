"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (RMSNorm on each query and key head) with
a mixture of experts in place of the MLP, as transformers' ``modeling_qwen3_moe`` computes it.

* ``sliding_window = S`` (set when ``use_sliding_window``) windows every layer: ``window_left = S - 1``.
* Layer ``i`` has the experts when it is not in ``mlp_only_layers`` and ``(i + 1) %
  decoder_sparse_step == 0``; the other layers have a dense gated MLP of ``intermediate_size``.
* The router (``mlp.gate``, no bias) takes a softmax over all ``num_experts`` logits in float32, keeps
  the ``num_experts_per_tok`` largest probabilities (renormalised to sum 1 when ``norm_topk_prob``),
  and weighs the chosen experts' outputs by them. Each expert is a gated MLP of
  ``moe_intermediate_size`` (``mlp.experts.{e}.{gate,up,down}_proj`` in checkpoints); there is no
  shared expert.
"""

from __future__ import annotations

from torch import nn

from ..distributed.group import TPGroup
from ..errors import expect, is_int
from .layers import GatedMLP, SelfAttention, SoftmaxTopKMoE, attention_spec, per_expert_checkpoint_name
from .qwen3 import Qwen3ForCausalLM


def check_config(config) -> None:
    experts, top_k, step = config.num_experts, config.num_experts_per_tok, config.decoder_sparse_step
    expect(is_int(experts) and experts >= 1, "num_experts >= 1", experts)
    expect(is_int(top_k) and 1 <= top_k <= experts, f"num_experts_per_tok in [1, num_experts {experts}]", top_k)
    expect(is_int(step) and step >= 1, "decoder_sparse_step >= 1", step)


def routed_experts_arguments(config) -> dict:
    """The :class:`SoftmaxTopKMoE` of a Qwen-MoE config (Qwen3-MoE's and Qwen2-MoE's routed experts)."""
    return dict(
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        act=config.hidden_act,
        normalize=bool(config.norm_topk_prob),
        weights_in_float32=False,
    )


def is_sparse_layer(config, layer_id: int) -> bool:
    return layer_id not in (config.mlp_only_layers or []) and (layer_id + 1) % config.decoder_sparse_step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config, *, tp: TPGroup | None = None):
        check_config(config)
        window = getattr(config, "sliding_window", None)
        expect(window is None or (is_int(window) and window >= 1), "sliding_window None or >= 1", window)
        super().__init__(config, tp=tp)

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        return per_expert_checkpoint_name(name) or super().checkpoint_name(name)

    def make_attention(self, config, layer_id: int) -> SelfAttention:
        window = getattr(config, "sliding_window", None)
        spec = attention_spec(config, layer_id, window_left=-1 if window is None else window - 1)
        bias = bool(getattr(config, "attention_bias", False))
        eps = config.rms_norm_eps
        return SelfAttention(config.hidden_size, spec, qkv_bias=bias, o_bias=bias, qk_norm_eps=eps, tp=self.tp)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return SoftmaxTopKMoE(**routed_experts_arguments(config), tp=self.tp)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=self.tp)
