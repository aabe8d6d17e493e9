"""The gated MLP of every decoder family: ``down(act(gate(x)) * up(x))``, gate and up in one matmul.

Under tensor parallelism gate/up is column-parallel and down row-parallel: one all-reduce per MLP
(none with ``reduce=False``, for a caller that adds other partial sums first, as a MoE layer's
shared expert does).
"""

from __future__ import annotations

import torch
from torch import nn

from ...distributed.group import TPGroup
from . import linear
from .activation import Activation, activation, gated
from .fp8_linear import FP8_DTYPE, FP8_MAX, MIN_SCALE, FP8Rows
from .fused import fused_ops
from .linear import MergedLinear, RowParallelLinear, norm_then_linear, project, project_gated, small_linear

# The gate/up weight's layout: rows alternating (a one-row launch's program streams one run of rows;
# an 8B's gate/up at one row 56 against 59 us on an H200), or False: [gate; up].
GATE_UP_INTERLEAVED = True
# quantization="fp8" on GPUs: the activation's launch quantizes the down projection's input rows (True), or the
# activation writes them in the model dtype and the down projection quantizes them (False; the benchmarks'
# --kernel-options unfused_fp8_activation).
QUANTIZE_IN_ACTIVATION = True


class GatedMLP(nn.Module):
    """``gate_up_proj`` holds the checkpoint's ``gate_proj`` (shard 0) and ``up_proj`` (shard 1), their
    rows alternating (``interleaved``, :data:`GATE_UP_INTERLEAVED`): a one-row launch's program streams
    one run of rows for its gate and up features."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        bias: bool = False,
        *,
        tp: TPGroup | None = None,
        reduce: bool = True,
    ):
        super().__init__()
        self.act = activation(act)
        size = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedLinear(hidden_size, size, bias, tp=tp, interleaved=GATE_UP_INTERLEAVED)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp=tp, reduce=reduce)

    def forward(
        self, x: torch.Tensor | FP8Rows, *, norm: nn.Module | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` (or its rows quantized by the norm before, :class:`FP8Rows`) -> ``[T, H]``; with ``norm``
        (the layer's post-attention RMSNorm) the input is ``norm(x + residual)`` and the return ``(out, x +
        residual)``: the norm and the activation run inside the gate/up projection where they can
        (:func:`~.linear.norm_then_linear`)."""
        if norm is None:
            ops = self._quantizing_ops(x)
            if ops is None and not isinstance(x, FP8Rows):
                return project(self.down_proj, project_gated(self.gate_up_proj, x, self.act))
            gate_up = self.gate_up_proj(x)  # (the vendor's matmul: rows quantized by the norm, or many rows)
            interleaved = self.gate_up_proj.interleaved
            if ops is None:
                return project(self.down_proj, gated(self.act, gate_up, interleaved))
            q, scale = ops.gated_activation_fp8(self.act.name, gate_up, interleaved, FP8_DTYPE, FP8_MAX, MIN_SCALE)
            return self.down_proj(FP8Rows(q, scale, gate_up.dtype))
        h, summed = norm_then_linear(self.gate_up_proj, x, norm, residual, self.act)
        out = small_linear(self.down_proj, h) if linear.SMALL_DOWN_PROJ else None
        return (self.down_proj(h) if out is None else out), summed

    def _quantizing_ops(self, x: torch.Tensor | FP8Rows):
        """The fused launchers when the activation's launch quantizes the down projection's input
        (``gated_activation_fp8``), else ``None``: fp8 down weights on a GPU, rows of ``x [T, H]`` that the
        projections take through the vendor's matmul (more than one, none in the fused small-batch launches; or
        quantized by the norm already), an activation the launch knows."""
        rows = x.q if isinstance(x, FP8Rows) else x
        ops = fused_ops(rows) if QUANTIZE_IN_ACTIVATION and self.down_proj.weight_scale is not None else None
        fits = (
            ops is not None
            and rows.dim() == 2
            and rows.shape[0] > 1
            and isinstance(self.act, Activation)
            and self.act.name in ops.ACTIVATION_CODES
            and linear._fp8_tile_ops(self.gate_up_proj, rows) is None
            and type(self.down_proj).forward in (linear.Linear.forward, RowParallelLinear.forward)
        )
        return ops if fits else None
