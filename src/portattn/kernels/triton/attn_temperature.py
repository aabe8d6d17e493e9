"""Llama 4's attention temperature on NoPE layers in one launch, where torch's code takes nine: each token's
queries times ``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1`` (float32), rounded to their dtype.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .pdl import wait_for_previous


@triton.jit
def attn_temperature_kernel(
    Q,
    Positions,
    Out,
    attn_scale,
    floor_scale,
    stride_q,
    stride_o,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program ``(t, b)``: ``BLOCK`` of token ``t``'s ``WIDTH`` query values (its heads' rows, contiguous).
    ``LIBDEVICE``: ``log1p`` from the device library (torch's on GPUs); else ``log(1 + x)`` (the interpreter)."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    steps = tl.floor((tl.load(Positions + t).to(tl.float32) + 1.0) / floor_scale)
    if LIBDEVICE:
        grown = libdevice.log1p(steps)
    else:
        grown = tl.log(1.0 + steps)
    scale = grown * attn_scale + 1.0
    q = tl.load(Q + t * stride_q + cols, mask=ok, other=0.0)
    tl.store(Out + t * stride_o + cols, (q.to(tl.float32) * scale).to(Out.dtype.element_ty), mask=ok)
