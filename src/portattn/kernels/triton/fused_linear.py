"""A linear layer of a few rows with the RMSNorm before it and the gated activation after it fused in:
the decode step's projections at small batches, where each launch costs more than its bytes.

``y = norm(x + residual) @ W^T (+ bias)`` over rows ``x [M, K]`` (``M`` up to ``BLOCK_M``), weight
``W [N, K]``; or, with ``GATED``, ``act(gate) * up`` of ``W = [W_gate; W_up]`` (``N`` the width of
each half). The norm is :mod:`.fused_norm`'s, value for value: ``r = x + residual`` rounded to the
dtype (written to ``ResidualOut`` by the first column block's programs), normalised in float32 and
scaled by the norm weight as ``MODE`` says; the activation is :mod:`.fused_activation`'s (gate and up
rounded to the dtype, the activation rounded before the product). Only the product's summation order
differs from the unfused layers'. Grid: ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``.

With ``BLOCK_K >= K`` (features up to a thousand or so: small models) a program issues every load at
once, its weight block with its rows, and computes the norm while the weight arrives: one memory
latency a launch. Wider rows take two passes over ``K`` (the sum of squares first, then the product);
rows are a few kilobytes, the weight block a program streams is what the time goes to.
"""

import triton
import triton.language as tl

from .fused_activation import activate
from .fused_rotary import rotate_halves
from .pdl import wait_for_previous


@triton.jit
def _rows(
    X,
    Residual,
    ResidualOut,
    rows64,
    ks,
    mask,
    stride_x,
    stride_r,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    WRITE: tl.constexpr,
):
    """``x + residual`` of rows ``rows64`` at features ``ks``, rounded to the dtype; with ``WRITE``,
    stored to ``ResidualOut`` by the first column block's programs."""
    x = tl.load(X + rows64[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + rows64[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        if WRITE:  # noqa: SIM102 (a constexpr, then a runtime test: Triton takes no mixed `and`)
            if tl.program_id(0) == 0:
                tl.store(ResidualOut + rows64[:, None] * stride_ro + ks[None, :], x, mask=mask)
    return x


@triton.jit
def _normed(x, inv_rms, NormWeight, ks, k_ok, MODE: tl.constexpr):
    """The norm of rows ``x`` given their ``inv_rms``, as :mod:`.fused_norm` rounds it."""
    dtype = x.dtype
    normed = x.to(tl.float32) * inv_rms[:, None]
    nw = tl.load(NormWeight + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    if MODE == 1:
        a = (normed * (1.0 + nw)).to(dtype)
    elif MODE == 2:
        a = (nw * normed).to(dtype)
    else:
        a = (nw * normed.to(dtype).to(tl.float32)).to(dtype)
    return a


@triton.jit
def _gate_up_rows(cols64, N, INTERLEAVED: tl.constexpr):
    """The weight rows of output features ``cols64``: ``(gate, up)`` rows ``(c, N + c)`` of a
    ``[gate; up]`` weight, or ``(2c, 2c + 1)`` where gate and up rows alternate (``INTERLEAVED``)."""
    if INTERLEAVED:
        rows64 = 2 * cols64
        up_rows64 = rows64 + 1
    else:
        rows64 = cols64
        up_rows64 = cols64 + N
    return rows64, up_rows64


@triton.jit
def _project(
    X,
    Residual,
    NormWeight,
    W,
    ResidualOut,
    rows64,
    row_ok,
    w_rows64,
    w_up_rows64,
    col_ok,
    K,
    eps,
    stride_x,
    stride_r,
    stride_ro,
    stride_w,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,
    PDL: tl.constexpr,
):
    """``(acc, acc_up)`` float32 ``[BLOCK_M, BLOCK_N]``: ``norm(x + residual)`` of rows ``rows64`` times
    the weight rows ``w_rows64`` (and, with ``GATED``, rows ``w_up_rows64``: the up half). An fp8 weight's
    tiles are converted to the rows' dtype before the dot (exactly: e4m3 values are float16 and bfloat16
    values); its scales are the caller's."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SINGLE:  # every load at once: the weight block arrives while the norm is computed
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(W + w_rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        if GATED:
            w_up = tl.load(W + w_up_rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        wait_for_previous(PDL)  # the weights are no earlier kernel's output: loaded before the wait
        mask = row_ok[:, None] & k_ok[None, :]
        a = _rows(X, Residual, ResidualOut, rows64, ks, mask, stride_x, stride_r, stride_ro, HAS_RESIDUAL, True)
        if HAS_NORM:
            h = a.to(tl.float32)
            a = _normed(a, 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / K + eps), NormWeight, ks, k_ok, MODE)
        acc = tl.dot(a, tl.trans(w.to(X.dtype.element_ty)), acc)
        if GATED:
            acc_up = tl.dot(a, tl.trans(w_up.to(X.dtype.element_ty)), acc_up)
    else:
        wait_for_previous(PDL)
        if HAS_NORM:
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                mask = row_ok[:, None] & (ks < K)[None, :]
                x = _rows(X, Residual, ResidualOut, rows64, ks, mask, stride_x, stride_r, stride_ro, HAS_RESIDUAL, True)
                h = x.to(tl.float32)
                squares += tl.sum(h * h, axis=1)
            inv_rms = 1.0 / tl.sqrt(squares / K + eps)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            mask = row_ok[:, None] & k_ok[None, :]
            a = _rows(X, Residual, ResidualOut, rows64, ks, mask, stride_x, stride_r, stride_ro, HAS_RESIDUAL, False)
            if HAS_NORM:
                a = _normed(a, inv_rms, NormWeight, ks, k_ok, MODE)
            w_mask = col_ok[:, None] & k_ok[None, :]
            w = tl.load(W + w_rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
            acc = tl.dot(a, tl.trans(w.to(X.dtype.element_ty)), acc)
            if GATED:
                w_up = tl.load(W + w_up_rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
                acc_up = tl.dot(a, tl.trans(w_up.to(X.dtype.element_ty)), acc_up)
    return acc, acc_up


@triton.jit
def norm_linear_kernel(
    X,
    Residual,
    NormWeight,
    W,
    WScale,
    Bias,
    Out,
    ResidualOut,
    M,
    N,
    K,
    eps,
    stride_x,
    stride_r,
    stride_ro,
    stride_w,
    stride_o,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    W_SCALED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """``W_SCALED``: ``W`` is fp8 and ``W[n] * WScale[n]`` (float32) the weight row ``n``."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    dtype = X.dtype.element_ty
    w_rows64, w_up_rows64 = _gate_up_rows(cols.to(tl.int64), N, INTERLEAVED)
    acc, acc_up = _project(
        X, Residual, NormWeight, W, ResidualOut, rows64, row_ok, w_rows64, w_up_rows64, col_ok, K, eps,
        stride_x, stride_r, stride_ro, stride_w, HAS_NORM, HAS_RESIDUAL, MODE, GATED, BLOCK_M, BLOCK_N, BLOCK_K,
        SINGLE, PDL,
    )  # fmt: skip
    if W_SCALED:
        acc *= tl.load(WScale + w_rows64, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(WScale + w_up_rows64, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + w_rows64, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(Bias + w_up_rows64, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if GATED:
        gate = y.to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        y = (activate(gate, ACT).to(dtype).to(tl.float32) * up).to(dtype)
    out_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(Out + rows64[:, None] * stride_o + cols[None, :], y, mask=out_mask)


@triton.jit
def _row_inv_rms(X, Residual, ResidualOut, row, K, eps, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 ROW: tl.constexpr):  # fmt: skip
    """``[1]`` float32: the one row's ``1 / rms(x + residual)`` from the whole row in one load (``ROW``: ``K``
    rounded up to a power of two), which also writes ``x + residual``; zeros without ``HAS_NORM``."""
    if HAS_NORM:
        features = tl.arange(0, ROW)
        whole = (features < K)[None, :]
        h = _rows(X, Residual, ResidualOut, row, features, whole, 0, 0, 0, HAS_RESIDUAL, True).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / K + eps)
    else:
        inv_rms = tl.zeros([1], dtype=tl.float32)
    return inv_rms


@triton.jit
def _row_features(
    X, Residual, NormWeight, ResidualOut, row, ks, inv_rms, K, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
):  # fmt: skip
    """The one row's ``norm(x + residual)`` at features ``ks``, ``[1, len(ks)]`` in its dtype (0 past ``K``)."""
    k_ok = ks < K
    a = _rows(X, Residual, ResidualOut, row, ks, k_ok[None, :], 0, 0, 0, HAS_RESIDUAL, False)
    if HAS_NORM:
        a = _normed(a, inv_rms, NormWeight, ks, k_ok, MODE)
    return a


@triton.jit
def _row_product(
    X,
    Residual,
    NormWeight,
    W,
    ResidualOut,
    rows64,
    up_rows64,
    col_ok,
    K,
    eps,
    stride_w,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW: tl.constexpr,
    PDL: tl.constexpr,
    in_scale=1.0,
    SCALE_INPUT: tl.constexpr = False,
):
    """``(y, up)`` float32 ``[BLOCK_N]``: ``norm(x + residual)`` of the one row times the weight rows
    ``rows64`` (and, with ``GATED``, rows ``up_rows64``), on the vector units: each step multiplies a
    ``[BLOCK_N, BLOCK_K]`` weight tile by the row's features elementwise into a float32 partial,
    summed at the end. The norm takes the whole row in one load first (``ROW``: ``K`` rounded up to a
    power of two), then each step reads its features again (from the cache). The first weight tile
    is loaded before the kernel waits for the one before it. ``SCALE_INPUT`` (without a norm): the row
    times ``in_scale`` (float32), rounded to its dtype, as ``(x * scale).to(x.dtype)`` rounds it."""
    row = tl.zeros([1], dtype=tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w_mask = col_ok[:, None] & k_ok[None, :]
    w = tl.load(W + rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    if GATED:
        w_up = tl.load(W + up_rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
    wait_for_previous(PDL)  # the weights are no earlier kernel's output: the first tile loaded before the wait
    inv_rms = _row_inv_rms(X, Residual, ResidualOut, row, K, eps, HAS_NORM, HAS_RESIDUAL, ROW)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        if k0 > 0:
            w_mask = col_ok[:, None] & k_ok[None, :]
            w = tl.load(W + rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
            if GATED:
                w_up = tl.load(W + up_rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        a = _row_features(X, Residual, NormWeight, ResidualOut, row, ks, inv_rms, K, HAS_NORM, HAS_RESIDUAL, MODE)
        if SCALE_INPUT:
            a = (a.to(tl.float32) * in_scale).to(X.dtype.element_ty)
        a = a.to(tl.float32)
        acc += w.to(tl.float32) * a
        if GATED:
            acc_up += w_up.to(tl.float32) * a
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _e4m3_words(words, ASM: tl.constexpr):
    """The four float32 values held by int32 ``words`` of four e4m3 bytes (byte ``j`` of a word, little-endian,
    the ``j``-th result). ``ASM`` (NVIDIA, compute capability >= 8.9): a byte pair to a float16 pair in one
    instruction (``cvt.rn.f16x2.e4m3x2``), then each half to float32: six instructions a word, against about
    eight a byte where Triton unpacks an fp8 tile itself. Otherwise (the interpreter) byte by byte; both exact."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, a, b, c, d;
            .reg .b32 h01, h23;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 h01, lo;
            cvt.rn.f16x2.e4m3x2 h23, hi;
            mov.b32 {a, b}, h01;
            mov.b32 {c, d}, h23;
            cvt.f32.f16 $0, a;
            cvt.f32.f16 $1, b;
            cvt.f32.f16 $2, c;
            cvt.f32.f16 $3, d;
            }""",
            constraints="=r,=r,=r,=r,r",
            args=[words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        return (
            (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
            ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
            ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
            ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
        )


@triton.jit
def _row_product_words(
    X,
    Residual,
    NormWeight,
    W,
    ResidualOut,
    rows64,
    row_ok,
    K,
    eps,
    stride_w,
    word_step,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
):
    """:func:`_row_product`'s sums over an e4m3 weight read as int32 words of four values (``K`` and the row
    stride multiples of 4), for the weight rows ``rows64`` (``[R]``, ``row_ok`` masking them): float32 ``[R]``,
    the weight's scale not applied. Feature ``4 w + j`` is byte ``j`` of word ``w``: the row's features are
    read in four strided sets, one for each byte. A lane reads one word at a time (``word_step``, 1 and not
    specialized, hides the words' contiguity from Triton, which would otherwise give a lane four words and
    move the converted tile through shared memory to meet the strided features' layout). The next block of
    words is loaded before this one is multiplied."""
    row = tl.zeros([1], dtype=tl.int64)
    Words = W.to(tl.pointer_type(tl.int32), bitcast=True)
    num_words = K // 4
    word_stride = stride_w // 4
    offs = tl.arange(0, BLOCK_K // 4)
    mask = row_ok[:, None] & (offs < num_words)[None, :]
    words = tl.load(Words + rows64[:, None] * word_stride + (offs * word_step)[None, :], mask=mask, other=0)
    wait_for_previous(PDL)  # the weights are no earlier kernel's output: the first block loaded before the wait
    inv_rms = _row_inv_rms(X, Residual, ResidualOut, row, K, eps, HAS_NORM, HAS_RESIDUAL, ROW)
    acc = tl.zeros([rows64.shape[0], BLOCK_K // 4], dtype=tl.float32)
    for w0 in range(0, num_words, BLOCK_K // 4):
        ws = w0 + offs
        next_ws = ws + BLOCK_K // 4
        next_mask = row_ok[:, None] & (next_ws < num_words)[None, :]
        next_words = tl.load(Words + rows64[:, None] * word_stride + (next_ws * word_step)[None, :], mask=next_mask,
                             other=0)  # fmt: skip
        w_0, w_1, w_2, w_3 = _e4m3_words(words, ASM)
        acc += w_0 * _row_features(X, Residual, NormWeight, ResidualOut, row, 4 * ws, inv_rms, K, HAS_NORM,
                                   HAS_RESIDUAL, MODE).to(tl.float32)  # fmt: skip
        acc += w_1 * _row_features(X, Residual, NormWeight, ResidualOut, row, 4 * ws + 1, inv_rms, K, HAS_NORM,
                                   HAS_RESIDUAL, MODE).to(tl.float32)  # fmt: skip
        acc += w_2 * _row_features(X, Residual, NormWeight, ResidualOut, row, 4 * ws + 2, inv_rms, K, HAS_NORM,
                                   HAS_RESIDUAL, MODE).to(tl.float32)  # fmt: skip
        acc += w_3 * _row_features(X, Residual, NormWeight, ResidualOut, row, 4 * ws + 3, inv_rms, K, HAS_NORM,
                                   HAS_RESIDUAL, MODE).to(tl.float32)  # fmt: skip
        words = next_words
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["word_step"])
def row_linear_kernel(
    X,
    Residual,
    NormWeight,
    W,
    WScale,
    Bias,
    Out,
    ResidualOut,
    N,
    K,
    eps,
    stride_w,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    W_SCALED: tl.constexpr = False,
    PDL: tl.constexpr = False,
    W_WORDS: tl.constexpr = False,
    ASM: tl.constexpr = False,
    word_step=1,
):
    """:func:`norm_linear_kernel` for one row ``x [1, K]`` on the vector units (:func:`_row_product`:
    no matrix-unit tile of 16 rows, no shared memory: every program is a few registers, many fit an
    SM and keep the memory busy). Values as :func:`norm_linear_kernel`'s; grid ``(cdiv(N, BLOCK_N),)``.
    ``INTERLEAVED`` (with ``GATED``): gate and up rows alternate (``g0, u0, g1, u1, ...``), so that a
    program streams one run of ``2 * BLOCK_N`` rows. ``W_WORDS`` (an e4m3 weight, ``K`` and ``stride_w``
    multiples of 4): :func:`_row_product_words` over the program's weight rows, gate and up rows in one
    block; ``ASM`` its conversion (see :func:`_e4m3_words`); ``word_step`` 1 (see there)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows64, up_rows64 = _gate_up_rows(cols.to(tl.int64), N, INTERLEAVED)
    if W_WORDS:
        if GATED:  # the program's 2 * BLOCK_N weight rows: gate rows then up rows, or alternating
            i = tl.arange(0, 2 * BLOCK_N)
            if INTERLEAVED:
                block_rows = 2 * tl.program_id(0).to(tl.int64) * BLOCK_N + i
                block_ok = tl.program_id(0) * BLOCK_N + i // 2 < N
            else:
                block_cols = tl.program_id(0) * BLOCK_N + i % BLOCK_N
                block_rows = block_cols.to(tl.int64) + tl.where(i < BLOCK_N, 0, N)
                block_ok = block_cols < N
            sums = _row_product_words(
                X, Residual, NormWeight, W, ResidualOut, block_rows, block_ok, K, eps, stride_w, word_step,
                HAS_NORM, HAS_RESIDUAL, MODE, BLOCK_K, ROW, PDL, ASM,
            )  # fmt: skip
            if INTERLEAVED:
                y, up = tl.split(tl.reshape(sums, [BLOCK_N, 2]))
            else:
                y, up = tl.split(tl.permute(tl.reshape(sums, [2, BLOCK_N]), (1, 0)))
        else:
            y = _row_product_words(
                X, Residual, NormWeight, W, ResidualOut, rows64, col_ok, K, eps, stride_w, word_step, HAS_NORM,
                HAS_RESIDUAL, MODE, BLOCK_K, ROW, PDL, ASM,
            )  # fmt: skip
    else:
        y, up = _row_product(
            X, Residual, NormWeight, W, ResidualOut, rows64, up_rows64, col_ok, K, eps, stride_w, HAS_NORM,
            HAS_RESIDUAL, MODE, GATED, BLOCK_N, BLOCK_K, ROW, PDL,
        )  # fmt: skip
    dtype = X.dtype.element_ty
    if W_SCALED:
        y *= tl.load(WScale + rows64, mask=col_ok, other=0.0)
        if GATED:
            up *= tl.load(WScale + up_rows64, mask=col_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(Bias + rows64, mask=col_ok, other=0.0).to(tl.float32)
    y = y.to(dtype)
    if GATED:
        if HAS_BIAS:
            up += tl.load(Bias + up_rows64, mask=col_ok, other=0.0).to(tl.float32)
        gate = y.to(tl.float32)
        y = (activate(gate, ACT).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(Out + cols, y, mask=col_ok)


@triton.jit
def expert_rows_kernel(
    X,
    Ids,
    Scale,
    W,
    Out,
    N,
    K,
    stride_x,
    stride_e,
    stride_w,
    stride_o,
    num_experts,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_IDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    SCALE_INPUT: tl.constexpr = False,
):
    """Routed (token, expert) pairs, a row of ``X [P, K]`` each: ``X[p] @ W[Ids[p], cols]^T`` on the
    vector units (:func:`_row_product`), with ``GATED`` ``act(gate) * up`` of the expert's gate and up
    rows (:func:`_gate_up_rows`) rounded as :func:`row_linear_kernel` rounds them. Only the routed
    experts' rows are read. A program takes ``TOP_K`` consecutive pairs (one token's) and stores their
    sum, each pair's result rounded to the dtype and, with ``HAS_SCALE``, multiplied by its ``Scale``
    (the routing weight) and rounded again, as the torch code combines a token's experts; ``TOP_K`` 1
    without a scale stores each pair's result. The expert ids are an earlier kernel's output: the
    kernel waits before its first load. Without ``HAS_IDS`` row ``p`` takes expert ``p % num_experts``
    (a token's heads, each its own weight). Grid ``(cdiv(N, BLOCK_N), P // TOP_K)``."""
    wait_for_previous(PDL)
    token = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows64, up_rows64 = _gate_up_rows(cols.to(tl.int64), N, INTERLEAVED)
    dtype = X.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        if HAS_IDS:
            expert = tl.load(Ids + pair).to(tl.int64)
        else:
            expert = pair % num_experts
        x = X + pair * stride_x
        in_scale = tl.load(Scale + pair).to(tl.float32) if SCALE_INPUT else 1.0
        y, up = _row_product(
            x, x, x, W + expert * stride_e, x, rows64, up_rows64, col_ok, K, 0.0, stride_w, False, False, 0, GATED,
            BLOCK_N, BLOCK_K, 16, False, in_scale, SCALE_INPUT,
        )  # fmt: skip
        y = y.to(dtype)
        if GATED:
            y = (activate(y.to(tl.float32), ACT).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
        if HAS_SCALE and not SCALE_INPUT:
            y = (y.to(tl.float32) * tl.load(Scale + pair).to(tl.float32)).to(dtype)
        total += y.to(tl.float32)
    tl.store(Out + token * stride_o + cols, total.to(dtype), mask=col_ok)


@triton.jit
def expert_tokens_kernel(
    X,
    Ids,
    Scale,
    W,
    Out,
    T,
    N,
    K,
    stride_xt,
    stride_xs,
    stride_e,
    stride_w,
    stride_o,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    SCALE_OUTPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One expert a program over the tokens routed to it, on the tensor cores: ``Out[t * TOP_K + s,
    cols] = X[t, s] @ W[e, cols]^T`` for every token ``t`` whose slot ``s`` of ``Ids [T, TOP_K]`` is
    this program's expert ``e`` (a token's experts distinct, as top-k gives them). ``X[t, s]`` is row
    ``t * stride_xt + s * stride_xs``: a token's row for each of its experts (``stride_xs`` 0) or a row a
    pair. ``SCALE_INPUT`` multiplies the row by the pair's ``Scale`` first, ``SCALE_OUTPUT`` the result,
    each rounded to the dtype as the torch code rounds them; with ``GATED`` the result is ``act(gate)
    * up`` as :func:`row_linear_kernel` rounds it. Each expert's weight block is read once per
    ``BLOCK_T`` tokens, and not at all by an expert no token chose. Grid ``(cdiv(N, BLOCK_N), E)``."""
    wait_for_previous(PDL)
    expert = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows64, up_rows64 = _gate_up_rows(cols.to(tl.int64), N, INTERLEAVED)
    w_base = W + expert.to(tl.int64) * stride_e
    slots = tl.arange(0, SLOTS)
    dtype = X.dtype.element_ty
    for t0 in range(0, T, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        t_ok = tokens < T
        ids = tl.load(Ids + tokens[:, None] * TOP_K + slots[None, :], mask=t_ok[:, None] & (slots < TOP_K)[None, :],
                      other=-1)  # fmt: skip
        hit = ids == expert  # [BLOCK_T, SLOTS]
        routed = tl.max(hit.to(tl.int32), axis=1) > 0
        if tl.max(routed.to(tl.int32), axis=0) > 0:
            slot = tl.sum(tl.where(hit, slots[None, :], 0), axis=1)
            pairs = tokens.to(tl.int64) * TOP_K + slot
            x_rows = tokens.to(tl.int64) * stride_xt + slot * stride_xs
            if SCALE_INPUT or SCALE_OUTPUT:
                scale = tl.load(Scale + pairs, mask=routed, other=0.0).to(tl.float32)
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                x = tl.load(X + x_rows[:, None] + ks[None, :], mask=routed[:, None] & k_ok[None, :], other=0.0)
                if SCALE_INPUT:
                    x = (x.to(tl.float32) * scale[:, None]).to(dtype)
                w_mask = col_ok[:, None] & k_ok[None, :]
                w = tl.load(w_base + rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
                acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
                if GATED:
                    w_up = tl.load(w_base + up_rows64[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
                    acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
            y = acc.to(dtype)
            if GATED:
                up = acc_up.to(dtype).to(tl.float32)
                y = (activate(y.to(tl.float32), ACT).to(dtype).to(tl.float32) * up).to(dtype)
            if SCALE_OUTPUT:
                y = (y.to(tl.float32) * scale[:, None]).to(dtype)
            tl.store(Out + pairs[:, None] * stride_o + cols[None, :], y, mask=routed[:, None] & col_ok[None, :])


@triton.jit
def _rotated(y1, y2, Cos, Sin, rows64, offs, mask, stride_cos, stride_sin, HALF: tl.constexpr):
    """``q * cos + rotate_half(q) * sin`` of the halves ``y1, y2`` at head features ``offs`` and
    ``HALF + offs``, rounded as :mod:`.fused_rotary` rounds it."""
    dtype = y1.dtype
    cos1 = tl.load(Cos + rows64[:, None] * stride_cos + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + rows64[:, None] * stride_cos + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + rows64[:, None] * stride_sin + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + rows64[:, None] * stride_sin + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(y1.to(tl.float32), y2.to(tl.float32), cos1, cos2, sin1, sin2, dtype)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def norm_linear_rotary_kernel(
    X,
    Residual,
    NormWeight,
    W,
    Bias,
    Cos,
    Sin,
    Slots,
    QOut,
    KCache,
    VCache,
    ResidualOut,
    M,
    K,
    eps,
    stride_x,
    stride_r,
    stride_ro,
    stride_w,
    stride_cos,
    stride_sin,
    stride_qt,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    PAIRS: tl.constexpr = BLOCK_N // 2  # of each half of a head, a program's columns
    head, first, cols = _head_columns(HEAD_DIM, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    col_ok = cols < (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    acc, _ = _project(
        X, Residual, NormWeight, W, ResidualOut, rows64, row_ok, cols.to(tl.int64), cols.to(tl.int64), col_ok, K, eps,
        stride_x, stride_r, stride_ro, stride_w, HAS_NORM, HAS_RESIDUAL, MODE, False, BLOCK_M, BLOCK_N, BLOCK_K,
        SINGLE, PDL,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(Bias + cols).to(tl.float32)[None, :]
    _store_heads(
        acc.to(X.dtype.element_ty), head, first, rows64, row_ok, Cos, Sin, Slots, QOut, KCache, VCache, stride_cos,
        stride_sin, stride_qt, stride_ks, stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
        BLOCK_M, PAIRS,
    )  # fmt: skip


@triton.jit
def _head_columns(HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(head, first, cols)`` of this program of a q/k/v projection with rotation: ``BLOCK_N / 2``
    features of each half of one head, from feature ``first`` of each half; ``cols`` the weight rows,
    the first half's run then the second's."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    head = tl.program_id(0) // (HALF // PAIRS)
    first = (tl.program_id(0) % (HALF // PAIRS)) * PAIRS
    c = tl.arange(0, BLOCK_N)
    return head, first, head * HEAD_DIM + (c // PAIRS) * HALF + first + c % PAIRS


@triton.jit
def _store_heads(
    y,
    head,
    first,
    rows64,
    row_ok,
    Cos,
    Sin,
    Slots,
    QOut,
    KCache,
    VCache,
    stride_cos,
    stride_sin,
    stride_qt,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """Rows ``y [BLOCK_M, 2 * PAIRS]`` of head ``head``'s features (:func:`_head_columns`), rounded to
    the dtype: queries and keys rotated, queries stored to ``QOut``, keys and values to their caches
    at the rows' ``Slots``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    y1, y2 = tl.split(tl.permute(tl.reshape(y, [BLOCK_M, 2, PAIRS]), (0, 2, 1)))  # the two halves' runs
    offs = first + tl.arange(0, PAIRS)
    mask = row_ok[:, None] & (offs < HALF)[None, :]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        y1, y2 = _rotated(y1, y2, Cos, Sin, rows64, offs, mask, stride_cos, stride_sin, HALF)
    if head < NUM_Q_HEADS:
        dst = QOut + rows64[:, None] * stride_qt + head * HEAD_DIM + offs[None, :]
    else:
        slots = tl.load(Slots + rows64, mask=row_ok, other=0)
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            dst = KCache + slots[:, None] * stride_ks + (head - NUM_Q_HEADS) * stride_kh + offs[None, :]
        else:
            dst = VCache + slots[:, None] * stride_vs + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vh + offs[None, :]
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)


@triton.jit
def row_linear_rotary_kernel(
    X,
    Residual,
    NormWeight,
    W,
    Bias,
    Cos,
    Sin,
    Slots,
    QOut,
    KCache,
    VCache,
    ResidualOut,
    K,
    eps,
    stride_w,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """:func:`norm_linear_rotary_kernel` for one row on the vector units (:func:`_row_product`): the
    same columns a program, values and stores. Grid ``((Hq + 2 Hkv) D / BLOCK_N,)``."""
    head, first, cols = _head_columns(HEAD_DIM, BLOCK_N)
    col_ok = cols < (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    y, _ = _row_product(
        X, Residual, NormWeight, W, ResidualOut, cols.to(tl.int64), cols.to(tl.int64), col_ok, K, eps, stride_w, HAS_NORM,
        HAS_RESIDUAL, MODE, False, BLOCK_N, BLOCK_K, ROW, PDL,
    )  # fmt: skip
    if HAS_BIAS:
        y += tl.load(Bias + cols).to(tl.float32)
    row = tl.zeros([1], dtype=tl.int64)
    _store_heads(
        y.to(X.dtype.element_ty)[None, :], head, first, row, row == 0, Cos, Sin, Slots, QOut, KCache, VCache, 0, 0, 0,
        stride_ks, stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1, BLOCK_N // 2,
    )  # fmt: skip


@triton.jit
def merge_linear_kernel(
    PartialOut,
    PartialLse,
    W,
    Out,
    N,
    num_heads,
    num_splits,
    stride_w,
    stride_o,
    HEADS_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The output projection of split attention rows: ``Out[t, cols] = merge(t) @ W[cols]^T`` where
    ``merge(t) [Hq * Dv]`` is ``merge.merge_splits_kernel``'s result for every head of row ``t``, rounded
    to ``Out``'s dtype as that kernel stores it (no sinks). ``W [N, Hq * Dv]``, feature ``h * Dv + d``.
    Each program merges every head of its row (the partials are a few kilobytes, read from L2) and
    multiplies by its ``BLOCK_N`` weight rows, loaded before it waits for the attention. Grid:
    ``(cdiv(N, BLOCK_N), T)``."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token = tl.program_id(1).to(tl.int64)
    hs = tl.arange(0, HEADS_PAD)
    ss = tl.arange(0, SPLITS_PAD)
    ds = tl.arange(0, BLOCK_DV)
    col_ok = cols < N
    h_ok = hs < num_heads
    s_ok = ss < num_splits
    d_ok = ds < VALUE_DIM
    features = hs[None, :, None] * VALUE_DIM + ds[None, None, :]
    w_mask = col_ok[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :]
    w = tl.load(W + cols.to(tl.int64)[:, None, None] * stride_w + features, mask=w_mask, other=0.0)
    wait_for_previous(PDL)  # the weights are no earlier kernel's output: loaded before the wait
    first = (token * num_heads + hs) * num_splits  # [HEADS_PAD] each head's first split
    hs_ok = h_ok[:, None] & s_ok[None, :]
    lse = tl.load(PartialLse + first[:, None] + ss[None, :], mask=hs_ok, other=float("-inf"))  # [H, S]
    m = tl.max(lse, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m_safe[:, None])
    denom = tl.sum(weight, 1)
    partial = tl.load(
        PartialOut + (first[:, None, None] + ss[None, :, None]) * BLOCK_DV + ds[None, None, :],
        mask=hs_ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )  # [H, S, DV]
    merged = tl.sum(partial * weight[:, :, None], 1) / tl.where(denom == 0.0, 1.0, denom)[:, None]  # [H, DV]
    merged = merged.to(Out.dtype.element_ty).to(tl.float32)
    out = tl.sum(tl.sum(w.to(tl.float32) * merged[None, :, :], 2), 1)  # [BLOCK_N]
    tl.store(Out + token * stride_o + cols, out.to(Out.dtype.element_ty), mask=col_ok)
