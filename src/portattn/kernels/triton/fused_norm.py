"""RMSNorm of one row, with the residual add before it: ``r = x + residual`` (rounded to the input
dtype, as a separate add would), ``y = weight * (r / rms(r))`` normalised in float32. Grid: ``(T,)``.

``MODE`` 0 (Llama, Qwen, DeepSeek): the normed row is rounded to the input dtype before the weight
multiplies it, as transformers computes ``weight * normed.to(dtype)``; 1 (Gemma): ``normed * (1 +
weight)`` in float32; 2 (gpt-oss): ``weight * normed`` in float32.

``add_rmsnorm_fp8_kernel``: the same row, rounded to the norm's output dtype, then quantized to fp8 with a
scale (the next linear layer's input, ``quantization="fp8"``; as ``fp8_quant.quantize_rows_kernel`` computes
it from the stored row): the normed row is not written in 16 bits.
"""

import triton
import triton.language as tl

from .fp8_quant import row_scale, scaled_to_fp8
from .pdl import wait_for_previous


@triton.jit
def add_rmsnorm_row(
    X, Residual, Weight, ResidualOut, row, offs, hidden, eps, stride_x, stride_r, stride_ro,
    HAS_RESIDUAL: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """Row ``row``'s ``weight * normed`` in float32 before its final rounding (the sum written to
    ``ResidualOut`` with a residual)."""
    mask = offs < hidden
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = h * inv_rms
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:
        y = normed * (1.0 + w)
    elif MODE == 2:
        y = w * normed
    else:
        y = w * normed.to(X.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def add_rmsnorm_kernel(
    X,
    Residual,
    Weight,
    Out,
    ResidualOut,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    y = add_rmsnorm_row(
        X, Residual, Weight, ResidualOut, row, offs, hidden, eps, stride_x, stride_r, stride_ro, HAS_RESIDUAL, MODE
    )
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=offs < hidden)


@triton.jit
def add_rmsnorm_fp8_kernel(
    X,
    Residual,
    Weight,
    Out,
    Scale,
    ResidualOut,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    ROUND_TO_X: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    y = add_rmsnorm_row(
        X, Residual, Weight, ResidualOut, row, offs, hidden, eps, stride_x, stride_r, stride_ro, HAS_RESIDUAL, MODE
    )
    if ROUND_TO_X:  # the norm's output dtype is the input's (else float32: nothing to round)
        y = y.to(X.dtype.element_ty).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(y), axis=0), FP8_MAX, MIN_SCALE)
    tl.store(Out + row * stride_o + offs, scaled_to_fp8(y, scale, FP8_MAX).to(Out.dtype.element_ty), mask=offs < hidden)
    tl.store(Scale + row, scale)
