"""Which path the elementwise layers take: fused Triton kernels on GPUs, their torch code elsewhere.

The torch code in each layer is the reference; the fused kernels (``kernels/triton/fused_*.py``)
compute the same values with fewer launches (one kernel for the residual add and RMSNorm, one for the
gated activation). :func:`set_fused_kernels` turns them off (to compare, or to count launches).

At small batches (up to :func:`fused_linear_rows` rows, the decode steps of a few sequences) a decoder
layer goes further: its norms run inside the projections after them and the gated activation inside
the gate/up projection (``kernels/triton/fused_linear.py``), three launches a layer fewer, since there
each launch costs more than the bytes it moves (models of up to 1024 hidden features: wider rows
stream faster through the vendor's matmul). :func:`set_fused_linear_rows` sets the bound (0: off).
"""

from __future__ import annotations

import functools
import logging

import torch

from ...device import is_gpu, is_triton_interpreter

logger = logging.getLogger("portattn")

_enabled = [True]
_linear_rows = [16]


def set_fused_kernels(enabled: bool) -> None:
    """Use the fused kernels on GPUs (the default) or the torch code everywhere."""
    _enabled[0] = bool(enabled)


def set_fused_linear_rows(rows: int) -> None:
    """Fold norms and gated activations into the projections of forwards of at most ``rows`` tokens
    (16, the kernel's row block, by default; 0: never)."""
    if not 0 <= rows <= 16:
        raise ValueError(f"expected fused linear rows in [0, 16], got {rows}")
    _linear_rows[0] = int(rows)


def fused_linear_rows() -> int:
    return _linear_rows[0]


@functools.cache
def _launchers():
    try:
        from ...kernels.triton import fused_launch
    except ImportError as exc:
        logger.info("fused kernels unavailable (%s): layers run their torch code", exc)
        return None
    return fused_launch


def fused_ops(x: torch.Tensor):
    """The fused launchers for ``x``'s device, or ``None`` where the torch code runs."""
    if not _enabled[0] or not is_gpu(x.device) or is_triton_interpreter():
        return None
    return _launchers()


def fused_linear_ops(x: torch.Tensor):
    """The fused launchers when a projection of ``x [T, H]`` takes its norm and activation in
    (``T`` at most :func:`fused_linear_rows`, float16 or bfloat16), else ``None``."""
    if x.dim() != 2 or x.shape[0] > _linear_rows[0] or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    return fused_ops(x)
