"""What every model class gives the engine, and the interface of models that take images."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from ..backends.base import AttentionSpec
from ..runtime.context import ForwardContext
from ..runtime.kv_cache import KVCacheSpec
from .layers import Embedding, LMHead, PagedAttention

if TYPE_CHECKING:
    from ..encoder import EncoderSeqInfo
    from ..runtime.multimodal import MultimodalData

# Per-layer scales of a quantised KV cache (``model.layers.3.self_attn.k_scale``; ``kv_scale`` sets both):
# not weights, read by the engine (``loader.kv_cache_scales``) when the cache is fp8.
KV_SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")

# Checkpoint module names that load into one merged module: name -> (merged name, shard id).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(nn.Module):
    """``forward``, ``compute_logits``, the KV cache spec and the checkpoint name map, for the engine.

    Subclasses build ``self.model`` (with ``embed_tokens``) and ``self.lm_head``; ``self.model``'s
    decoder layers follow the one signature of :mod:`portattn.models.layers.decoder`.
    """

    model: nn.Module
    lm_head: LMHead
    attention_ops: ClassVar[tuple[str, ...]] = ("paged_attention",)  # backend ops the model calls
    # A class that shards itself over a tensor-parallel group takes ``tp=`` (a TPGroup) when built.
    supports_tensor_parallel: ClassVar[bool] = False
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = PACKED_MODULES
    # Quantization methods the class loads itself (beyond the loader's own "fp8", dequantized at load).
    quant_methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> final hidden states ``[T, H]``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]

    def prepare_static(self, max_tokens: int) -> None:
        """Make forwards of up to ``max_tokens`` tokens free of host syncs (what a captured step
        records must not read the device): every submodule with a ``prepare_static(max_tokens)`` of
        its own gets the call (a mixture-of-experts layer keeps its sync-free dense path up to that
        many tokens). Calls only raise limits, never lower them."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"expected max_tokens to be a positive int, got {max_tokens!r}")
        for module in self.modules():
            prepare = getattr(module, "prepare_static", None)
            if module is not self and callable(prepare):
                prepare(max_tokens)

    def attention_specs(self) -> list[AttentionSpec]:
        return [m.spec for m in self.modules() if isinstance(m, PagedAttention)]

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec.mha_from_specs(self.attention_specs())

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tied_parameters(self) -> frozenset[str]:
        """Parameters that :meth:`tie_weights` fills from others (not read from the checkpoint)."""
        return frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """``(parameter, shard)`` a checkpoint tensor loads into (``shard`` None: the whole parameter),
        or ``None`` for a tensor this model does not use."""
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if name.endswith("rotary_emb.inv_freq"):  # saved by older transformers; recomputed from the config
            return None
        if KV_SCALE_KEY.search(name):
            return None
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in self.packed_modules:
                merged, shard = self.packed_modules[part]
                return ".".join([*parts[:i], merged, *parts[i + 1 :]]), shard
        return name, None

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            embed: Embedding = self.model.embed_tokens
            self.lm_head.tie(embed)


@runtime_checkable
class MultimodalModel(Protocol):
    """A model whose prompts may carry images (Qwen2.5-VL). The engine validates a prompt's images with
    :meth:`multimodal_data`, and in each step's plan step runs :meth:`plan_images` (every host sync of
    the encoder) then :meth:`encode_planned_images` for the requests whose placeholders it reaches."""

    def multimodal_data(
        self, token_ids: list[int], pixel_values: torch.Tensor | None, image_grid_thw
    ) -> MultimodalData | None: ...

    def expand_placeholders(self, token_ids: list[int], image_grid_thw) -> list[int]: ...

    def plan_images(self, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> EncoderSeqInfo: ...

    def encode_planned_images(self, pixel_values: torch.Tensor, plan: EncoderSeqInfo) -> torch.Tensor: ...

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw) -> torch.Tensor: ...
