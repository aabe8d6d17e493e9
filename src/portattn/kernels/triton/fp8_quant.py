"""Dynamic per-row fp8 quantization of a linear layer's input: one program a row.

Program ``r`` finds ``amax = max |x[r]|`` over the row in steps of ``BLOCK`` features, takes ``scale =
max(amax / FP8_MAX, MIN_SCALE)``, writes ``clamp(x[r] / scale)`` in fp8 (IEEE division, as torch's) and
``Scale[r] = scale`` (float32). Grid: ``(rows,)``.
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous


@triton.jit
def row_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's scale from its largest magnitude: ``max(amax / FP8_MAX, MIN_SCALE)`` (IEEE division)."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def scaled_to_fp8(x, scale, FP8_MAX: tl.constexpr):
    """``clamp(x / scale, -FP8_MAX, FP8_MAX)`` (IEEE division; the caller converts it to the fp8 dtype)."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)


@triton.jit
def quantize_rows_kernel(
    X,
    Out,
    Scale,
    cols,
    stride_x,
    stride_out,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    top = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < cols, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    scale = row_scale(tl.max(top, axis=0), FP8_MAX, MIN_SCALE)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < cols, other=0.0).to(tl.float32)
        q = scaled_to_fp8(x, scale, FP8_MAX)
        tl.store(Out + row * stride_out + offs, q.to(Out.dtype.element_ty), mask=offs < cols)
    tl.store(Scale + row, scale)
