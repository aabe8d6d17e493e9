"""RMSNorm as the Hugging Face families compute it (three variants), and the parameter-free L2 norm."""

from __future__ import annotations

import torch
from torch import nn

from .fp8_linear import FP8_DTYPE, FP8_MAX, MIN_SCALE, FP8Rows, quantize_input
from .fused import fused_ops


class RMSNorm(nn.Module):
    """``x / rms(x)`` scaled by the weight, normalised in float32.

    ``unit_offset=False`` (Llama, Qwen, DeepSeek): ``weight * normed.to(x.dtype)``, weight init 1.
    ``unit_offset=True`` (Gemma): ``(normed * (1 + weight)).to(x.dtype)`` in float32, weight init 0.
    ``weight_in_float32=True`` (gpt-oss): ``(weight * normed).to(x.dtype)`` in float32.

    ``forward(x, residual)`` adds the residual first and returns ``(norm(x + residual), x +
    residual)`` (the sum rounded to the dtype, as a separate add would): a decoder layer's
    "residual add, then norm" in one fused kernel on GPUs (``kernels/triton/fused_norm.py``).
    """

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False, weight_in_float32: bool = False):
        super().__init__()
        if unit_offset and weight_in_float32:
            raise ValueError("expected one of unit_offset and weight_in_float32, got both")
        self.eps, self.unit_offset, self.weight_in_float32 = eps, unit_offset, weight_in_float32
        self.weight = nn.Parameter((torch.zeros if unit_offset else torch.ones)(dim), requires_grad=False)

    @property
    def mode(self) -> str:
        return "unit_offset" if self.unit_offset else "float32" if self.weight_in_float32 else "dtype"

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops(x)
        if ops is not None:
            out, summed = ops.add_rmsnorm(x, self.weight, self.eps, residual, mode=self.mode)
            return out if residual is None else (out, summed)
        if residual is not None:
            summed = x + residual
            return self.norm(summed), summed
        return self.norm(x)

    def quantized(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[FP8Rows, torch.Tensor]:
        """``(quantize_rows(norm(x + residual)), x + residual)`` for ``x, residual [T, H]`` (``residual`` None:
        ``x`` is the stream): the next linear layer's input in fp8 (``quantization="fp8"``, :class:`FP8Rows` in
        the norm's output dtype), in one launch on GPUs, where the normed rows are not written in 16 bits."""
        ops = fused_ops(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
            dtype = torch.promote_types(self.weight.dtype, x.dtype) if self.mode == "dtype" else x.dtype
            q, scale, summed = ops.add_rmsnorm_fp8(
                x, self.weight, self.eps, residual, mode=self.mode, dtype=FP8_DTYPE, fp8_max=FP8_MAX,
                min_scale=MIN_SCALE,
            )  # fmt: skip
            return FP8Rows(q, scale, dtype), (x if residual is None else summed)
        out, summed = (self(x), x) if residual is None else self(x, residual)
        rows = out.reshape(-1, out.shape[-1])
        return FP8Rows(*quantize_input(rows if rows.stride(-1) == 1 else rows.contiguous()), out.dtype), summed

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference of the norm alone."""
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
