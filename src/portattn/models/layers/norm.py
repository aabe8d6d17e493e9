"""RMSNorm as the Hugging Face families compute it (three variants), and the parameter-free L2 norm."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x)`` scaled by the weight, normalised in float32.

    ``unit_offset=False`` (Llama, Qwen, DeepSeek): ``weight * normed.to(x.dtype)``, weight init 1.
    ``unit_offset=True`` (Gemma): ``(normed * (1 + weight)).to(x.dtype)`` in float32, weight init 0.
    ``weight_in_float32=True`` (gpt-oss): ``(weight * normed).to(x.dtype)`` in float32.
    """

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False, weight_in_float32: bool = False):
        super().__init__()
        if unit_offset and weight_in_float32:
            raise ValueError("expected one of unit_offset and weight_in_float32, got both")
        self.eps, self.unit_offset, self.weight_in_float32 = eps, unit_offset, weight_in_float32
        self.weight = nn.Parameter((torch.zeros if unit_offset else torch.ones)(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        if self.weight_in_float32:
            return (self.weight.float() * h).to(x.dtype)
        return self.weight * h.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in float32 (Llama 4's q/k norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
