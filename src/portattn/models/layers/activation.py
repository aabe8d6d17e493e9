"""Activations by their Hugging Face ``hidden_act`` names, the gated form ``act(gate) * up``, and
gpt-oss's clamped SwiGLU."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .fused import fused_ops

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Activation:
    """An activation function that knows its Hugging Face name (for the fused gated kernel)."""

    def __init__(self, name: str):
        self.name, self.fn = name, ACTIVATIONS[name]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def activation(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise ValueError(f"expected hidden_act in {sorted(ACTIVATIONS)}, got {name!r}")
    return Activation(name)


def gated(
    act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """``gate_up [..., 2I]`` (gate half first; ``interleaved``: gate and up features alternate,
    ``g0, u0, g1, u1, ...``) -> ``act(gate) * up [..., I]`` (one fused kernel on GPUs for an
    :class:`Activation`; the torch code below is the reference)."""
    ops = fused_ops(gate_up)
    if ops is not None and isinstance(act, Activation) and gate_up.stride(-1) == 1:
        return ops.gated_activation(act.name, gate_up, interleaved)
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1) if interleaved else gate_up.chunk(2, dim=-1)
    return act(gate) * up


class ClampedSwiGLU:
    """gpt-oss's expert activation on ``gate_up [..., 2I]`` with interleaved columns
    ``[g0, u0, g1, u1, ...]`` (as its checkpoints store them) -> ``[..., I]``:
    ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``."""

    def __init__(self, alpha: float, limit: float):
        if not limit > 0:
            raise ValueError(f"expected a positive swiglu limit, got {limit}")
        self.alpha, self.limit = float(alpha), float(limit)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # [..., I] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha}, limit={self.limit})"
