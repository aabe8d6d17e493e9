"""Building blocks shared by the model families: RMSNorm, rotary embeddings, gated MLP, attention.

Each block computes exactly what its Hugging Face counterpart computes (same dtype casts, same
order of operations), so that the engine's logits match ``transformers`` to float rounding.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..backends.base import AttentionBackend, AttentionLayer, PagedMetadata
from ..engine.kv_pool import KVCacheSpec

# Rope types whose frequencies depend on the sequence length at run time are not supported.
_DYNAMIC_ROPE = ("dynamic", "longrope")


class ForwardContext(Protocol):
    """What a model reads besides its inputs (built by the engine once per forward)."""

    backend: AttentionBackend
    metadata: PagedMetadata

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D_rot / 2] float32 on the CPU, attention_scaling)`` from transformers' rope init."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type in _DYNAMIC_ROPE or rope_type not in ROPE_INIT_FUNCTIONS:
        static = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in _DYNAMIC_ROPE)]
        raise ValueError(f"expected a rope_type in {static}, got {rope_type!r}")
    with torch.device("cpu"):  # models are built under torch.device("meta"); the buffers are real
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotate-half ("neox") rotary embedding, as Llama and Qwen3 apply it."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        if 2 * inv_freq.shape[0] != head_dim:
            raise ValueError(f"expected rotary embeddings over the whole head dim {head_dim}, got {2 * len(inv_freq)}")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.scaling).to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = (emb.sin() * self.scaling).to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; parameter names follow Hugging Face's."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        if act != "silu":
            raise ValueError(f"expected hidden_act 'silu', got {act!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PagedAttention(nn.Module):
    """Hands one layer's ``q, k, v`` to the backend: writes K/V into the paged cache and attends."""

    def __init__(self, spec: AttentionLayer):
        super().__init__()
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        spec = self.spec
        q = q.view(-1, spec.num_heads, spec.head_dim)  # [T, Hq, D]
        k = k.view(-1, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, D]
        v = v.view(-1, spec.num_kv_heads, spec.v_head_dim)  # [T, Hkv, Dv]
        out = ctx.backend.forward(q, k, v, spec, ctx.metadata, ctx.kv_cache(spec.layer_id))
        return out.flatten(1)  # [T, Hq * Dv]


class CausalLM(nn.Module):
    """What every model class gives the engine: ``forward``, ``compute_logits``, KV and weight facts."""

    model: nn.Module
    lm_head: nn.Linear
    attention_ops: tuple[str, ...] = ("paged_attention",)  # backend ops the model calls; checked at start-up

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> final hidden states ``[T, H]``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]

    def attention_layers(self) -> list[AttentionLayer]:
        return [m.spec for m in self.modules() if isinstance(m, PagedAttention)]

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec.mha_from_layers(self.attention_layers())

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into (``None``: not used by this model)."""
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if name.endswith("rotary_emb.inv_freq"):  # saved by older transformers; recomputed from the config
            return None
        return name

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
