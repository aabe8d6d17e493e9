"""Rotary position embeddings: the frequency tables and every rotation the families use.

Each module makes its ``table(positions, dtype)`` once per forward (the model does, for every layer
that shares the module) and rotates with ``apply(..., *table)`` or ``apply(..., table)``:

* :class:`RotaryEmbedding`: rotate-half ("neox") over the whole head (Llama, Qwen, Gemma); its
  ``rope_parameters`` may differ per layer (``layer_type``, Gemma 3's local and global bases);
* :class:`InterleavedRotaryEmbedding`: consecutive pairs as complex numbers (Llama 4);
* :class:`PartialRotaryEmbedding`: the ``qk_rope_head_dim`` dims of MLA heads, interleaved or not
  (DeepSeek V3);
* :class:`MRotaryEmbedding`: three position rows t, h, w sharing the frequencies (Qwen2-VL, Qwen2.5-VL);
* :func:`apply_rotary_float32`: the vision tower's 2D rotation, applied in float32.

Frequency buffers are built on the CPU in float32 (models are built on their device; buffers move
with ``model.to``), as transformers builds them, so that the angles match to the last bit.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import expect
from .fused import fused_ops

# Rope types whose frequencies depend on the sequence length at run time are not supported.
_DYNAMIC_ROPE = ("dynamic", "longrope")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's ``rope_parameters`` (those of ``layer_type`` when they are given per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params


def rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D_rot / 2] float32 on the CPU, attention_scaling)`` from transformers' rope init."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # (imported where used: its import is slow)

    if rope_type in _DYNAMIC_ROPE or rope_type not in ROPE_INIT_FUNCTIONS:
        static = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in _DYNAMIC_ROPE)]
        raise ValueError(f"expected a rope_type in {static}, got {rope_type!r}")
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding over the whole head dim: ``forward(positions [T], q, k)``."""

    def __init__(self, config, head_dim: int, *, layer_type: str | None = None):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim, layer_type)
        expect(2 * inv_freq.shape[0] == head_dim, f"rotary embeddings over the whole head dim {head_dim}",
               2 * inv_freq.shape[0])  # fmt: skip
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``freqs [T, D / 2]`` -> ``cos, sin [T, 1, D]`` in ``dtype``."""
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return (emb.cos() * self.scaling).to(dtype)[:, None, :], (emb.sin() * self.scaling).to(dtype)[:, None, :]

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, D]`` of the tokens at ``positions [T]``: once per forward, shared by every
        layer (on GPUs one fused launch, ``fused_launch.rotary_table``, where torch's code takes nine)."""
        ops = fused_ops(positions)
        if ops is not None and positions.dim() == 1 and self.inv_freq.device == positions.device:
            cos, sin = ops.rotary_table(positions, self.inv_freq, self.scaling, dtype)
            return cos[:, None, :], sin[:, None, :]
        return self.cos_sin(positions[:, None].float() * self.inv_freq[None, :], dtype)

    @staticmethod
    def apply(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]`` rotated by a :meth:`table` (the reference of the fused
        rotary + cache-write kernel)."""
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(q, k, *self.table(positions, q.dtype))


class InterleavedRotaryEmbedding(nn.Module):
    """Rotation of consecutive pairs ``(x[2i], x[2i+1])``, in complex float32 as transformers' Llama 4 does."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``freqs_cis [T, D / 2]`` complex64 of the tokens at ``positions [T]`` (the rotation runs in
        float32 whatever ``dtype``)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        return torch.polar(torch.ones_like(freqs), freqs) * self.scaling  # [T, D / 2] complex

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]`` rotated by a :meth:`table`."""
        return _rotate_pairs(q, freqs_cis), _rotate_pairs(k, freqs_cis)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(q, k, self.table(positions, q.dtype))


def _rotate_pairs(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [T, H, D / 2] complex
    return torch.view_as_real(pairs * freqs_cis[:, None, :]).flatten(2).type_as(x)  # [T, H, D]


class PartialRotaryEmbedding(nn.Module):
    """Rotary embedding of ``rope_dim`` dims (MLA's decoupled rope): interleaved pairs, written back as
    ``[rotated evens | rotated odds]`` as transformers' DeepSeek V3 does, or rotate-half."""

    def __init__(self, config, rope_dim: int, *, interleave: bool):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, rope_dim)
        expect(2 * inv_freq.shape[0] == rope_dim, f"rotary frequencies for all {rope_dim} rope dims",
               2 * inv_freq.shape[0])  # fmt: skip
        self.interleave = interleave
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, Dr / 2]`` (interleaved) or ``[T, Dr]`` (rotate-half), in ``dtype``; once per forward."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, Dr / 2]
        emb = freqs if self.interleave else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, H, Dr]`` rotated by ``cos, sin`` of :meth:`table`."""
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, *]
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, Dr / 2] each
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return x * cos + rotate_half(x) * sin


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over three position rows: frequency ``i`` rotates by the position on row
    ``axis[i]`` (``mrope_section = [a, b, c]``: the first ``a`` frequencies read t, the next ``b`` h,
    the last ``c`` w). ``forward(positions [3, T], q, k)``."""

    def __init__(self, config, head_dim: int):
        super().__init__(config, head_dim)
        section = list(rope_parameters(config).get("mrope_section") or [])
        expect(
            len(section) == 3 and sum(section) == head_dim // 2,
            f"mrope_section of three sizes summing to head_dim / 2 = {head_dim // 2}",
            section,
        )
        axis = torch.cat([torch.full((n,), i, device="cpu") for i, n in enumerate(section)])  # [D / 2]
        self.register_buffer("axis", axis, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, D]`` of the tokens at ``positions [3, T]``."""
        freqs = positions[:, :, None].float() * self.inv_freq  # [3, T, D / 2]
        freqs = freqs.gather(0, self.axis.expand(1, freqs.shape[1], -1))[0]  # [T, D / 2]
        return self.cos_sin(freqs, dtype)


def apply_rotary_float32(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [N, H, D]``, ``cos, sin [N, D]`` float32 -> rotated in float32, returned in q's dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
    qf, kf = q.float(), k.float()
    return (qf * cos + rotate_half(qf) * sin).to(q.dtype), (kf * cos + rotate_half(kf) * sin).to(k.dtype)
