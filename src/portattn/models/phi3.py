"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's layout with the q, k and v projections stored as one
``qkv_proj`` tensor and the gate and up projections as one ``gate_up_proj`` (both loaded into the
merged layers, each tensor-parallel rank narrowing to its rows before reading), and a sliding window on
every layer when ``sliding_window`` is set, as transformers' ``modeling_phi3`` computes it.

Rotary embeddings over part of the head (``partial_rotary_factor < 1``) and ``longrope`` scaling
(Phi-3-mini-128k, Phi-4-mini) are refused at load.
"""

from __future__ import annotations

from ..distributed.group import TPGroup
from .layers import FUSED
from .mistral import MistralForCausalLM

_FUSED_TENSORS = tuple(f"{m}.{p}" for m in ("self_attn.qkv_proj", "mlp.gate_up_proj") for p in ("weight", "bias"))


class Phi3ForCausalLM(MistralForCausalLM):
    def __init__(self, config, *, tp: TPGroup | None = None):
        super().__init__(config, tp=tp)
        for layer in self.model.layers:
            layer.self_attn.qkv_proj.fuse_checkpoint_shards()
            layer.mlp.gate_up_proj.fuse_checkpoint_shards()

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        if name.endswith(_FUSED_TENSORS):
            return name, FUSED
        return super().checkpoint_name(name)
