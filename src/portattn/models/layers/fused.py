"""Which path the elementwise layers take: fused Triton kernels on GPUs, their torch code elsewhere.

The torch code in each layer is the reference; the fused kernels (``kernels/triton/fused_*.py``)
compute the same values with fewer launches (one kernel for the residual add and RMSNorm, one for the
gated activation). :func:`set_fused_kernels` turns them off (to compare, or to count launches).
"""

from __future__ import annotations

import functools
import logging

import torch

from ...device import is_gpu, is_triton_interpreter

logger = logging.getLogger("portattn")

_enabled = [True]


def set_fused_kernels(enabled: bool) -> None:
    """Use the fused kernels on GPUs (the default) or the torch code everywhere."""
    _enabled[0] = bool(enabled)


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
