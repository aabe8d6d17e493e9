"""Gated activation ``act(gate) * up`` of rows ``[gate | up]`` (gate half first) or of rows whose gate and
up features alternate (``[g0, u0, g1, u1, ...]``), as transformers computes it in the model dtype: the
activation is rounded to the dtype before the product.
Grid: ``(T, cdiv(I, BLOCK))``.

``ACT``: 0 silu, 1 gelu (erf), 2 gelu (tanh approximation).
"""

import triton
import triton.language as tl

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
    mask = offs < inter
    if INTERLEAVED:  # one load of the [BLOCK, 2] pairs
        pairs = offs[:, None] * 2 + tl.arange(0, 2)[None, :]
        g, u = tl.split(tl.load(GateUp + row * stride_in + pairs, mask=mask[:, None], other=0.0).to(tl.float32))
    else:
        g = tl.load(GateUp + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GateUp + row * stride_in + inter + offs, mask=mask, other=0.0).to(tl.float32)
    a = activate(g, ACT).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_out + offs, (a * u).to(Out.dtype.element_ty), mask=mask)
