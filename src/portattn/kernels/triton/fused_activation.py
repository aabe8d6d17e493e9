"""Gated activation ``act(gate) * up`` of rows ``[gate | up]`` (gate half first) or of rows whose gate and
up features alternate (``[g0, u0, g1, u1, ...]``), as transformers computes it in the model dtype: the
activation is rounded to the dtype before the product.
Grid: ``(T, cdiv(I, BLOCK))``.

``gated_activation_fp8_kernel``: the same rows, rounded to the model dtype, then quantized to fp8 with a
scale each (the next linear layer's input, ``quantization="fp8"``; as ``fp8_quant.quantize_rows_kernel``
computes it from the stored rows): the activation's output never goes to memory. One program a row; with
``ONE_BLOCK`` the whole row stays in registers (one read), else two passes (the scale, then the values).
Grid: ``(T,)``.

``ACT``: 0 silu, 1 gelu (erf), 2 gelu (tanh approximation).
"""

import triton
import triton.language as tl

from .fp8_quant import row_scale, scaled_to_fp8
from .pdl import wait_for_previous

SILU, GELU, GELU_TANH = 0, 1, 2


@triton.jit
def activate(g, ACT: tl.constexpr):
    """``act(g)`` in float32 (``g`` float32)."""
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = tl.exp(-2.0 * tl.abs(z))  # tanh(|z|) = (1 - t) / (1 + t), no overflow
        tanh = (1.0 - t) / (1.0 + t)
        a = 0.5 * g * (1.0 + tl.where(z < 0, -tanh, tanh))
    return a


@triton.jit
def gated_activation_kernel(
    GateUp,
    Out,
    inter,
    stride_in,
    stride_out,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    y = gated_block(GateUp, row, stride_in, offs, inter, ACT, INTERLEAVED)  # (Out has GateUp's dtype)
    tl.store(Out + row * stride_out + offs, y.to(Out.dtype.element_ty), mask=offs < inter)


@triton.jit
def gated_block(GateUp, row, stride_in, offs, inter, ACT: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``act(gate) * up`` at features ``offs`` of row ``row``, the activation and the product each rounded to
    ``GateUp``'s dtype, in float32 (0 past ``inter``)."""
    mask = offs < inter
    if INTERLEAVED:  # one load of the [BLOCK, 2] pairs
        pairs = offs[:, None] * 2 + tl.arange(0, 2)[None, :]
        g, u = tl.split(tl.load(GateUp + row * stride_in + pairs, mask=mask[:, None], other=0.0).to(tl.float32))
    else:
        g = tl.load(GateUp + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GateUp + row * stride_in + inter + offs, mask=mask, other=0.0).to(tl.float32)
    a = activate(g, ACT).to(GateUp.dtype.element_ty).to(tl.float32)
    return (a * u).to(GateUp.dtype.element_ty).to(tl.float32)


@triton.jit
def gated_activation_fp8_kernel(
    GateUp,
    Out,
    Scale,
    inter,
    stride_in,
    stride_out,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    ONE_BLOCK: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    if ONE_BLOCK:  # BLOCK >= inter: the row in registers
        offs = tl.arange(0, BLOCK)
        y = gated_block(GateUp, row, stride_in, offs, inter, ACT, INTERLEAVED)
        scale = row_scale(tl.max(tl.abs(y), axis=0), FP8_MAX, MIN_SCALE)
        tl.store(Out + row * stride_out + offs, scaled_to_fp8(y, scale, FP8_MAX).to(Out.dtype.element_ty),
                 mask=offs < inter)  # fmt: skip
    else:
        top = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, inter, BLOCK):
            y = gated_block(GateUp, row, stride_in, start + tl.arange(0, BLOCK), inter, ACT, INTERLEAVED)
            top = tl.maximum(top, tl.abs(y))
        scale = row_scale(tl.max(top, axis=0), FP8_MAX, MIN_SCALE)
        for start in range(0, inter, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = gated_block(GateUp, row, stride_in, offs, inter, ACT, INTERLEAVED)
            tl.store(Out + row * stride_out + offs, scaled_to_fp8(y, scale, FP8_MAX).to(Out.dtype.element_ty),
                     mask=offs < inter)  # fmt: skip
    tl.store(Scale + row, scale)
