"""Activations by their Hugging Face ``hidden_act`` names, and the gated form ``act(gate) * up``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"expected hidden_act in {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [..., 2I]`` (gate half first) -> ``act(gate) * up [..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
