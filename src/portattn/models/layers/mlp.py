"""The gated MLP of every decoder family: ``down(act(gate(x)) * up(x))``, gate and up in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from .activation import activation, gated
from .linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """``gate_up_proj`` holds the checkpoint's ``gate_proj`` (shard 0) and ``up_proj`` (shard 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.act = activation(act)
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.act, self.gate_up_proj(x)))
