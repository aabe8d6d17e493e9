"""Launchers of the fused kernels (RMSNorm with the residual add, gated activation, rotary with the
cache write and the rotary table, a small-batch linear with the norm before it and the activation after
it, sampling and the greedy argmax).

The model layers call these on GPUs (``models/layers/norm.py``, ``activation.py``, ``linear.py``,
``rotary.py``), the Triton backend the rotary write, the engine's sampler the draws and the argmax; the
torch code of each is the reference and the path everywhere else.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ...device import compute_units, is_triton_interpreter
from . import compile_ahead
from .argmax import argmax_chunks_kernel, argmax_merge_kernel
from .attn_temperature import attn_temperature_kernel
from .fp8_quant import quantize_rows_kernel
from .fused_activation import GELU, GELU_TANH, SILU, gated_activation_fp8_kernel, gated_activation_kernel
from .fused_linear import (
    expert_rows_kernel,
    expert_tokens_kernel,
    merge_linear_kernel,
    norm_linear_kernel,
    norm_linear_rotary_kernel,
    row_linear_kernel,
    row_linear_rotary_kernel,
)
from .fused_norm import add_rmsnorm_fp8_kernel, add_rmsnorm_kernel
from .fused_rotary import latent_rotary_write_kernel, rotary_kv_write_kernel, rotary_pairs_kernel, rotary_table_kernel
from .grouped_topk import grouped_topk_kernel
from .gumbel_max import gumbel_max_kernel
from .kv_write import kv_write_kernel
from .launch import dot_precision, next_pow2, pdl_options
from .nucleus import nucleus_kernel
from .router_topk import router_topk_kernel

NORM_MODES = {"dtype": 0, "unit_offset": 1, "float32": 2}
# Rows with top_k up to this take their k-th largest score from torch.topk (a radix select) before the
# nucleus kernel; larger k are searched in the kernel, 16 pivots a pass over the scores. On an H200 over
# 128,256 scores (benchmarks/results/engine_h200/round5/topk_timing.txt) the search added 0.6-0.7 ms to
# the draw at batch 1 and 64; torch.topk of 64 / 256 / 1024 scores took 0.056 / 0.068 / 0.068 ms at
# batch 1 and 0.137 / 0.149 / 0.155 ms at 64.
TOP_K_CAP = 1024
# norm_linear: rows per launch (one row block: every program streams its weight block once for all rows),
# and the features up to which a program loads its whole weight block at once.
NORM_LINEAR_ROWS = 16
NORM_LINEAR_SINGLE_K = 1024
ACTIVATION_CODES = {"silu": SILU, "swish": SILU, "gelu": GELU, "gelu_pytorch_tanh": GELU_TANH, "gelu_tanh": GELU_TANH}


def add_rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    mode: str = "dtype",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rmsnorm(x + residual), x + residual)`` for ``x, residual [T, H]`` (rows contiguous);
    ``(rmsnorm(x), None)`` without a residual. ``mode``: where the weight applies, as ``RMSNorm``
    (``"dtype"``: to the normed row rounded to the dtype, output in the dtype of ``weight * x`` as in
    torch; ``"unit_offset"``: ``1 + weight`` in float32; ``"float32"``: the weight in float32)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()  # rows may be strided, their elements not
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if mode == "dtype" else x.dtype
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        residual2 = residual.reshape(-1, hidden)
        residual2 = residual2 if residual2.stride(-1) == 1 else residual2.contiguous()
        residual_out = torch.empty_like(x2)
    else:
        residual2 = residual_out = x2  # unused
    rows = x2.shape[0]
    if rows:
        block = next_pow2(hidden)
        add_rmsnorm_kernel[(rows,)](
            x2, residual2, weight, out, residual_out, hidden, eps,
            x2.stride(0), residual2.stride(0), out.stride(0), residual_out.stride(0),
            HAS_RESIDUAL=residual is not None, MODE=NORM_MODES[mode], BLOCK=block,
            num_warps=max(1, min(16, block // 256)), **pdl_options(x.device),
        )  # fmt: skip
    out = out.view(x.shape)
    return out, (residual_out.view(x.shape) if residual is not None else None)


def add_rmsnorm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    *,
    mode: str,
    dtype: torch.dtype,
    fp8_max: float,
    min_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q [T, H], scale [T, 1], x + residual)``: :func:`add_rmsnorm`'s rows of ``x, residual [T, H]`` (rows'
    elements contiguous) quantized as :func:`quantize_fp8_rows` quantizes them, in one launch (the normed rows
    are not written); ``(q, scale, None)`` without a residual."""
    hidden = x.shape[-1]
    rows = x.shape[0]
    round_to_x = mode != "dtype" or torch.promote_types(weight.dtype, x.dtype) == x.dtype
    out = torch.empty((rows, hidden), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    if rows:
        block = next_pow2(hidden)
        r, ro = (residual, residual_out) if residual is not None else (x, x)  # (unused without a residual)
        add_rmsnorm_fp8_kernel[(rows,)](
            x, r, weight, out, scale, ro, hidden, eps, x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
            HAS_RESIDUAL=residual is not None, MODE=NORM_MODES[mode], ROUND_TO_X=round_to_x, FP8_MAX=fp8_max,
            MIN_SCALE=min_scale, BLOCK=block, num_warps=max(1, min(16, block // 256)), **pdl_options(x.device),
        )  # fmt: skip
    return out, scale, residual_out


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    """:func:`norm_linear`'s tiles: output columns and input features a step per program, its warps and
    pipeline stages."""

    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def linear_tiles(out_features: int, in_features: int, device: torch.device, *, gated: bool = False, rows: int = 1):
    """16 columns a program. A plain projection of up to ``NORM_LINEAR_SINGLE_K`` features takes them
    all in one step (every load at once; 8 warps past 4 rows); a gated one 256 features a step over 3
    stages (its two weight blocks at once spill). On an H200 at SmolLM2's shapes
    (``benchmarks/results/engine_h200/round6``): q/k/v 4.2 us against 5.1 unfused, gate/up 6.3 against
    7.2. Wider rows: the widest column block (64, 32, 16) that gives every compute unit two programs,
    128 features a step."""
    if in_features <= NORM_LINEAR_SINGLE_K:
        if gated:
            return LinearTiles(16, min(256, max(16, next_pow2(in_features))), 4, 3)
        return LinearTiles(16, max(16, next_pow2(in_features)), 4 if rows <= 4 else 8, 1)
    units = compute_units(device)
    block_n = next((n for n in (64, 32) if -(-out_features // n) >= 2 * units), 16)
    return LinearTiles(block_n, 128)


# row_linear's tiles: 8 weight rows (of each half when gated) and 1024 features a step in 4 warps
# (num_stages unused: its loop keeps the loads in registers). On an H200 at Llama-3-8B's projections
# (benchmarks/results/engine_h200/round15/row_linears.json) 1024 features a step streamed at 82-101% of
# copy where 512 reached 64-91% and 8 warps or 256 features less; 4 rows a program ran within 4% of 8.
ROW_LINEAR_TILES = LinearTiles(8, 1024, 4, 1)
# ... and of a gated launch over alternating gate and up rows: 4 features, one run of 8 rows, a program
# (round16/gated_rows*.json: 8B's gate/up with its norm and SiLU 55.4-55.9 us, 99-100% of copy, against 58.9-59.4 with
# 8 features of [gate; up] halves, the plain product over the same rows 55.0).
ROW_LINEAR_GATED_TILES = LinearTiles(4, 1024, 4, 1)
# row_linear over an fp8 (e4m3) weight read as int32 words of four values, each converted in six
# instructions (fused_linear._row_product_words), where the features, the row stride and the weight's
# address are multiples of 4, instead of Triton's own fp8 tiles, whose sm_90 code spends about 9 instructions
# a weight and moves the row's features through shared memory each step (5.5 and none with these tiles,
# compiled for sm_90 at Llama-3-8B's q/k/v with its norm). Off until it has run on a GPU (its inline PTX has
# not: tests/kernels/test_fused_linear.py checks it there both ways); `--kernel-options fp8_row_words` in the
# engine benchmarks turns it on. Its tiles: 16 weight rows a program (8 gate and 8 up rows when gated),
# 1024 features a step, the next step's words loaded first.
ROW_LINEAR_WORDS = False
ROW_LINEAR_WORDS_TILES = LinearTiles(16, 1024, 4, 1)
ROW_LINEAR_WORDS_GATED_TILES = LinearTiles(8, 1024, 4, 1)
# One-row forwards over at least this many features take row_linear (models/layers/linear.py).
ROW_LINEAR_K = 2048
# The Triton backend's forward_projected of such a row in one launch with the rotation and the cache
# write (row_linear_rotary); off: on an H200 Llama-3-8B's batch-1 async step took 4.37-4.38 ms with it
# against 4.32 with row_linear and the rotary write's own launch (one call,
# benchmarks/results/engine_h200/round15/NOTES.md: a program's two runs of 4 weight rows stream slower).
ROW_LINEAR_ROTARY = False


def _weight_scale(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor | None:
    """An fp8 weight's per-row float32 scales (``[1, N]`` or ``[N]``, contiguous); ``None`` for a 16-bit one."""
    if (weight.dtype == torch.float8_e4m3fn) != (weight_scale is not None):
        raise ValueError(f"expected a weight_scale with an fp8 weight and only then, got {weight.dtype} and "
                         f"{None if weight_scale is None else tuple(weight_scale.shape)}")  # fmt: skip
    if weight_scale is not None and (
        weight_scale.dtype != torch.float32
        or weight_scale.numel() != weight.shape[0]
        or not weight_scale.is_contiguous()
    ):
        raise ValueError(f"expected {weight.shape[0]} contiguous float32 weight scales, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")  # fmt: skip
    return weight_scale


def _check_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, norm_weight) -> None:
    """What :func:`norm_linear` and :func:`norm_linear_rotary` take: at most ``NORM_LINEAR_ROWS`` rows of
    float16 or bfloat16 and a weight of their dtype, contiguous rows, a residual like ``x`` with a norm."""
    rows, in_features = x.shape
    if rows > NORM_LINEAR_ROWS:
        raise ValueError(f"expected at most {NORM_LINEAR_ROWS} rows for norm_linear, got {rows}")
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype not in (x.dtype, torch.float8_e4m3fn):
        raise ValueError(
            f"expected float16 or bfloat16 rows and a weight of their dtype or float8_e4m3fn, got {x.dtype} and "
            f"{weight.dtype}"
        )
    if weight.shape[1] != in_features or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"expected x [M, K] and weight [N, K] with contiguous rows, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if residual is not None:
        if norm_weight is None:
            raise ValueError("expected a norm_weight with a residual (the sum is the norm's input), got none")
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"expected a residual like x {tuple(x.shape)}, got {tuple(residual.shape)}")


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    mode: str = "dtype",
    act: str | None = None,
    tiles: LinearTiles | None = None,
    interleaved: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, summed)`` for rows ``x [M, K]``, ``M <= NORM_LINEAR_ROWS``, in float16 or bfloat16:
    ``y = rmsnorm(x + residual) @ weight.T + bias`` (:func:`add_rmsnorm`'s norm of ``norm_weight`` in
    ``mode``; without a ``norm_weight``, and then without a residual, ``x @ weight.T + bias``),
    ``summed = x + residual`` (None without a residual).
    With ``act`` (a gated activation's name) ``weight`` is ``[gate; up]`` (``[2I, K]``) and ``y`` is
    ``act(gate) * up [M, I]``, as :func:`gated_activation` of the unfused product; ``interleaved``:
    the weight's (and bias's) gate and up rows alternate instead, ``g0, u0, g1, u1, ...``.
    ``weight_scale``: ``weight`` is float8 e4m3 and row ``n`` of the weight is ``weight[n] * weight_scale[n]``
    (``quantization="fp8"``'s layers: the fp8 weight read, the rows not quantized)."""
    rows, in_features = x.shape
    out_features = weight.shape[0] // (2 if act else 1)
    _check_rows(x, weight, residual, norm_weight)
    weight_scale = _weight_scale(weight, weight_scale)
    if act is not None and weight.shape[0] % 2:
        raise ValueError(f"expected a [gate; up] weight of an even number of rows, got {weight.shape[0]}")
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(x)
    if rows == 0:
        return out, summed
    tiles = tiles or linear_tiles(out_features, in_features, x.device, gated=act is not None, rows=rows)
    grid = (triton.cdiv(out_features, tiles.block_n), 1)
    norm_linear_kernel[grid](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight, weight,
        x if weight_scale is None else weight_scale, x if bias is None else bias, out, x if summed is None else summed,
        rows, out_features, in_features, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), 0 if summed is None else summed.stride(0),
        weight.stride(0), out.stride(0),
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, MODE=NORM_MODES[mode],
        HAS_BIAS=bias is not None, GATED=act is not None, ACT=ACTIVATION_CODES[act] if act else 0,
        BLOCK_M=NORM_LINEAR_ROWS, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SINGLE=tiles.block_k >= in_features,
        INTERLEAVED=interleaved and act is not None, W_SCALED=weight_scale is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return out, summed


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    mode: str = "dtype",
    act: str | None = None,
    tiles: LinearTiles | None = None,
    interleaved: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`norm_linear` of one row ``x [1, K]`` on the vector units (``fused_linear.row_linear_kernel``):
    the same arguments, values and returns; for rows of a few thousand features and more, where a
    matrix-unit tile of 16 rows streams the weight slower than many small programs do. ``interleaved``
    (with ``act``): the weight's (and bias's) gate and up rows alternate, ``g0, u0, g1, u1, ...``."""
    rows, in_features = x.shape
    out_features = weight.shape[0] // (2 if act else 1)
    _check_rows(x, weight, residual, norm_weight)
    weight_scale = _weight_scale(weight, weight_scale)
    if rows != 1:
        raise ValueError(f"expected one row for row_linear, got {rows}")
    if act is not None and weight.shape[0] % 2:
        raise ValueError(f"expected a [gate; up] weight of an even number of rows, got {weight.shape[0]}")
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(x)
    words = weight_scale is not None and ROW_LINEAR_WORDS and _in_words(weight)
    if words:
        tiles = tiles or (ROW_LINEAR_WORDS_GATED_TILES if act else ROW_LINEAR_WORDS_TILES)
    else:
        tiles = tiles or (ROW_LINEAR_GATED_TILES if interleaved and act else ROW_LINEAR_TILES)
    row_linear_kernel[(triton.cdiv(out_features, tiles.block_n),)](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight, weight,
        x if weight_scale is None else weight_scale, x if bias is None else bias, out, x if summed is None else summed,
        out_features, in_features, eps, weight.stride(0),
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, MODE=NORM_MODES[mode],
        HAS_BIAS=bias is not None, GATED=act is not None, ACT=ACTIVATION_CODES[act] if act else 0,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, ROW=next_pow2(in_features) if norm_weight is not None else 16,
        INTERLEAVED=interleaved and act is not None, W_SCALED=weight_scale is not None,
        W_WORDS=words, ASM=words and _e4m3_pairs_in_one_instruction(x.device), word_step=1,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return out, summed


def _in_words(weight: torch.Tensor) -> bool:
    """Whether an fp8 weight reads as int32 words: its features, row stride and address multiples of 4."""
    return weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0


def _e4m3_pairs_in_one_instruction(device: torch.device) -> bool:
    """Whether Triton launches on ``device`` take ``fused_linear._e4m3_words``' PTX (NVIDIA; the interpreter
    runs no inline assembly). fp8 weights reach these launches only where fp8 matmuls are wired up
    (``portattn.quantization``: compute capability >= 8.9, which has the instruction)."""
    return device.type == "cuda" and torch.version.hip is None and not is_triton_interpreter()


def _check_experts(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Stacked expert weights ``[E, N, K]`` of the rows' dtype, for rows ``x [*, K]``."""
    in_features = x.shape[-1]
    if weight.dim() != 3 or weight.shape[2] != in_features or weight.dtype != x.dtype:
        raise ValueError(f"expected expert weights [E, N, {in_features}] of {x.dtype}, got {weight.dtype} "
                         f"{tuple(weight.shape)}")  # fmt: skip


def expert_rows(
    x: torch.Tensor,
    ids: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    act: str | None = None,
    interleaved: bool = False,
    tiles: LinearTiles | None = None,
    top_k: int = 1,
    scale: torch.Tensor | None = None,
    scale_input: bool = False,
) -> torch.Tensor:
    """Routed experts' projections, one (token, expert) pair a row: ``x [P, K]`` (a pair's input),
    ``ids [P]`` (its expert), ``weight [E, N, K]`` -> ``[P, N]``, ``x[p] @ weight[ids[p]].T``; with
    ``act`` (a gated activation's name) ``weight [E, 2I, K]`` holds each expert's gate and up rows (two
    halves, or alternating with ``interleaved``) and the result is ``act(gate) * up [P, I]``. Reads the
    routed experts' rows only (each pair its own), on the vector units as :func:`row_linear`: for
    decode steps of fewer pairs than experts. ``ids`` None: row ``p`` takes expert ``p % E`` (rows of
    tokens' E heads, each head its own weight slice: MLA's absorbed value product at one token).

    Combined by token: with ``top_k`` > 1 the pairs are ``T`` tokens' ``top_k`` experts (pair ``t *
    top_k + s``) and the result is ``[T, N]``, each token's pairs summed; ``scale [T, top_k]`` (the
    routing weights) multiplies each pair's result first. Each product is rounded to x's dtype as
    ``(out.view(T, top_k, N) * scale[..., None]).to(x.dtype).sum(1)`` rounds it. ``scale_input`` (with
    ``scale [P, 1]`` and ``top_k`` 1): the weight multiplies each pair's input row instead, as ``(x *
    scale).to(x.dtype)`` rounds it (Llama 4's experts see their input scaled)."""
    pairs, in_features = x.shape
    _check_experts(x, weight)
    if ids is None and pairs % weight.shape[0]:
        raise ValueError(f"expected rows of whole tokens' heads, a multiple of {weight.shape[0]}, got {pairs}")
    if ids is not None and (ids.shape != (pairs,) or (pairs and ids.stride(0) != 1)):
        raise ValueError(f"expected one expert id per row, [{pairs}] contiguous, got {tuple(ids.shape)} "
                         f"strides {ids.stride()}")  # fmt: skip
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(1) != in_features:
        raise ValueError("expected rows and expert weights with contiguous features")
    if top_k < 1 or pairs % top_k:
        raise ValueError(f"expected rows of whole tokens, a multiple of top_k {top_k}, got {pairs}")
    tokens = pairs // top_k
    if scale is not None and (scale.shape != (tokens, top_k) or not scale.is_contiguous()):
        raise ValueError(f"expected contiguous routing weights ({tokens}, {top_k}), got {tuple(scale.shape)}")
    if scale_input and (scale is None or top_k != 1):
        raise ValueError(f"expected routing weights [{pairs}, 1] and top_k 1 to scale the inputs, got top_k {top_k}"
                         f"{'' if scale is not None else ' and no weights'}")  # fmt: skip
    out_features = weight.shape[1] // (2 if act else 1)
    out = torch.empty((tokens, out_features), dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    tiles = tiles or (ROW_LINEAR_GATED_TILES if interleaved and act else ROW_LINEAR_TILES)
    expert_rows_kernel[(triton.cdiv(out_features, tiles.block_n), tokens)](
        x, x if ids is None else ids, x if scale is None else scale, weight, out, out_features, in_features,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), weight.shape[0], GATED=act is not None,
        ACT=ACTIVATION_CODES[act] if act else 0, INTERLEAVED=interleaved and act is not None, TOP_K=top_k,
        HAS_SCALE=scale is not None, HAS_IDS=ids is not None,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        SCALE_INPUT=scale_input, **pdl_options(x.device),
    )  # fmt: skip
    return out


# expert_tokens: 64 features of each expert and 64 features a step in 4 warps over 3 stages, up to 64 tokens a
# block (at least 16: the tensor cores' rows).
EXPERT_TOKENS_TILES = LinearTiles(64, 64, 4, 3)
EXPERT_TOKENS_BLOCK = 64


def expert_tokens(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    act: str | None = None,
    interleaved: bool = False,
    scale: torch.Tensor | None = None,
    scale_input: bool = False,
    tiles: LinearTiles | None = None,
) -> torch.Tensor:
    """Routed experts' projections, one expert a program over the tokens that chose it: ``topk_ids
    [T, k]`` (a token's experts distinct, as top-k gives them), ``weight [E, N, K]``, ``x`` either
    ``[T, K]`` (each token's row, the same for its k experts) or ``[T * k, K]`` (a row a (token,
    expert) pair, pair ``t * k + s``) -> ``[T * k, N]`` by pair, ``x[pair] @ weight[topk_ids[t, s]].T``.
    With ``act`` (a gated activation's name) ``weight [E, 2I, K]`` holds each expert's gate and up rows
    (two halves, or alternating with ``interleaved``) and the result is ``act(gate) * up [T * k, I]``.
    ``scale [T, k]`` (the routing weights) multiplies each pair's row first (``scale_input``) or its
    result, rounded to x's dtype. Each chosen expert's weight is read once per 64 tokens, an expert no
    token chose not at all: for steps of as many pairs as experts or more, where :func:`expert_rows`
    would read an expert once for each of its pairs."""
    tokens, top_k = topk_ids.shape
    rows, in_features = x.shape
    if rows not in (tokens, tokens * top_k):
        raise ValueError(f"expected rows [{tokens}, {in_features}] (a token's) or [{tokens * top_k}, {in_features}] "
                         f"(a pair's) for top-k ids {tuple(topk_ids.shape)}, got {tuple(x.shape)}")  # fmt: skip
    _check_experts(x, weight)
    if not topk_ids.is_contiguous() or x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(1) != in_features:
        raise ValueError("expected contiguous top-k ids, and rows and expert weights with contiguous features")
    if scale is not None and (scale.shape != topk_ids.shape or not scale.is_contiguous()):
        raise ValueError(f"expected contiguous routing weights {tuple(topk_ids.shape)}, got {tuple(scale.shape)}")
    if scale_input and scale is None:
        raise ValueError("scale_input needs the routing weights (scale)")
    out_features = weight.shape[1] // (2 if act else 1)
    out = torch.empty((tokens * top_k, out_features), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    tiles = tiles or EXPERT_TOKENS_TILES
    per_pair = rows == tokens * top_k and top_k > 1
    expert_tokens_kernel[(triton.cdiv(out_features, tiles.block_n), weight.shape[0])](
        x, topk_ids, x if scale is None else scale, weight, out, tokens, out_features, in_features,
        x.stride(0) * (top_k if per_pair else 1), x.stride(0) if per_pair else 0, weight.stride(0),
        weight.stride(1), out.stride(0), TOP_K=top_k, SLOTS=next_pow2(top_k), GATED=act is not None,
        ACT=ACTIVATION_CODES[act] if act else 0, INTERLEAVED=interleaved and act is not None,
        SCALE_INPUT=scale is not None and scale_input, SCALE_OUTPUT=scale is not None and not scale_input,
        DOT_PRECISION=dot_precision(x.dtype), BLOCK_T=max(16, min(EXPERT_TOKENS_BLOCK, next_pow2(tokens))),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl_options(x.device),
    )  # fmt: skip
    return out


def _check_rotary(x, weight, cos, sin, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, tiles: LinearTiles):
    """What :func:`norm_linear_rotary` and :func:`row_linear_rotary` take besides the rows: a q/k/v
    weight of whole heads of a multiple of ``tiles.block_n`` features, K/V caches of x's dtype, one
    shape and contiguous, rows of cos and sin with a contiguous last dim. Returns the head dim and
    ``cos, sin [M, D]``."""
    rows = x.shape[0]
    heads = num_q_heads + 2 * num_kv_heads
    head_dim = weight.shape[0] // heads
    if weight.shape[0] != heads * head_dim or head_dim % tiles.block_n:
        raise ValueError(f"expected a q/k/v weight of {heads} heads of a multiple of {tiles.block_n} features, "
                         f"got {tuple(weight.shape)}")  # fmt: skip
    if k_cache.dtype != x.dtype or v_cache.dtype != x.dtype or k_cache.shape[-1] != head_dim:
        raise ValueError(f"expected K/V caches of {x.dtype} and head dim {head_dim}, got {k_cache.dtype} "
                         f"{tuple(k_cache.shape)} and {v_cache.dtype} {tuple(v_cache.shape)}")  # fmt: skip
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.shape != k_cache.shape:
        raise ValueError("expected contiguous K/V caches of one shape (a slot is page * P + offset)")
    cos, sin = cos.reshape(rows, head_dim), sin.reshape(rows, head_dim)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"expected cos and sin with a contiguous last dim, got strides {cos.stride()}, {sin.stride()}")
    return head_dim, cos, sin


def row_linear_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    mode: str = "dtype",
    tiles: LinearTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`norm_linear_rotary` of one row ``x [1, K]`` on the vector units, as :func:`row_linear`:
    the same arguments, values, stores and returns (``tiles.block_n`` dividing the head dim)."""
    tiles = tiles or ROW_LINEAR_TILES
    head_dim, cos, sin = _check_rotary(x, weight, cos, sin, k_cache, v_cache, num_q_heads, num_kv_heads, tiles)
    _check_rows(x, weight, residual, norm_weight)
    _weight_scale(weight, None)  # a weight of the rows' dtype: no fp8 weights here
    if x.shape[0] != 1:
        raise ValueError(f"expected one row for row_linear_rotary, got {x.shape[0]}")
    q = torch.empty((1, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(x)
    in_features = x.shape[1]
    row_linear_rotary_kernel[(weight.shape[0] // tiles.block_n,)](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight, weight,
        x if bias is None else bias, cos, sin, slots, q, k_cache, v_cache, x if summed is None else summed,
        in_features, eps, weight.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, MODE=NORM_MODES[mode],
        HAS_BIAS=bias is not None, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, ROW=next_pow2(in_features) if norm_weight is not None else 16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return q, summed


def norm_linear_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    mode: str = "dtype",
    tiles: LinearTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(q, summed)``: :func:`norm_linear`'s q/k/v projection of rows ``x [M, K]`` (``weight =
    [W_q; W_k; W_v]``, ``[(Hq + 2 Hkv) D, K]``) with :func:`rotary_kv_write` after it, in one launch:
    q and k rotated by ``cos, sin [M, D]`` (the rotate-half embedding, rows in x's dtype), the rotated
    queries returned ``[M, Hq, D]``, the rotated keys and the values stored at cache ``slots [M]``
    (``k_cache``, ``v_cache [N, P, Hkv, D]`` contiguous, in x's dtype). The same values as the two
    launches: each program takes ``block_n / 2`` features of each half of one head."""
    rows, in_features = x.shape
    tiles = tiles or linear_tiles(weight.shape[0], in_features, x.device, rows=rows)
    head_dim, cos, sin = _check_rotary(x, weight, cos, sin, k_cache, v_cache, num_q_heads, num_kv_heads, tiles)
    _check_rows(x, weight, residual, norm_weight)
    _weight_scale(weight, None)  # a weight of the rows' dtype: no fp8 weights here
    q = torch.empty((rows, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(x)
    if rows == 0:
        return q, summed
    grid = (weight.shape[0] // tiles.block_n, 1)
    norm_linear_rotary_kernel[grid](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight, weight,
        x if bias is None else bias, cos, sin, slots, q, k_cache, v_cache, x if summed is None else summed,
        rows, in_features, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), 0 if summed is None else summed.stride(0),
        weight.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, MODE=NORM_MODES[mode],
        HAS_BIAS=bias is not None, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=NORM_LINEAR_ROWS, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SINGLE=tiles.block_k >= in_features,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return q, summed


# merge_linear: the partials one program merges (heads x splits x value columns, padded to powers of two,
# splits to at least MERGE_LINEAR_SPLITS: one compiled kernel for every short decode's split count) stay in
# registers up to this many elements; the weight rows a program takes.
MERGE_LINEAR_ELEMENTS = 8192
MERGE_LINEAR_SPLITS = 8
MERGE_LINEAR_BLOCK_N = 8


def _splits_pad(num_splits: int) -> int:
    return max(MERGE_LINEAR_SPLITS, next_pow2(num_splits))


def merge_linear_fits(num_heads: int, num_splits: int, value_dim: int) -> bool:
    """Whether :func:`merge_linear` takes partials of this many heads, splits and value columns."""
    return next_pow2(num_heads) * _splits_pad(num_splits) * next_pow2(value_dim) <= MERGE_LINEAR_ELEMENTS


def merge_linear(partial_out: torch.Tensor, partial_lse: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``merge(partials) @ weight.T [T, N]`` in ``weight``'s dtype: the split-KV partials of an attention
    launch (``attention_forward(unmerged=...)``: ``partial_out [T, Hq, S, next_pow2(Dv)]`` and
    ``partial_lse [T, Hq, S]`` float32) merged per head as the merge kernel merges them (no sinks) and
    projected by ``weight [N, Hq * Dv]``, in one launch: the attention layer's output projection at
    small batches, without the merge kernel before it."""
    rows, num_heads, num_splits, block_dv = partial_out.shape
    out_features, in_features = weight.shape
    value_dim = in_features // num_heads
    if (
        in_features != num_heads * value_dim
        or block_dv != next_pow2(value_dim)
        or tuple(partial_lse.shape) != (rows, num_heads, num_splits)
        or partial_out.dtype != torch.float32
        or partial_lse.dtype != torch.float32
        or not (partial_out.is_contiguous() and partial_lse.is_contiguous())
    ):
        raise ValueError(
            f"expected contiguous float32 partials [T, Hq, S, next_pow2(Dv)] and [T, Hq, S] for a weight "
            f"[N, Hq * Dv], got {tuple(partial_out.shape)} {partial_out.dtype}, {tuple(partial_lse.shape)} "
            f"{partial_lse.dtype} and {tuple(weight.shape)}"
        )
    if not merge_linear_fits(num_heads, num_splits, value_dim) or weight.stride(-1) != 1:
        raise ValueError(f"expected at most {MERGE_LINEAR_ELEMENTS} padded heads x splits x value columns and a "
                         f"weight with contiguous rows, got {num_heads} x {num_splits} x {value_dim}, "
                         f"strides {weight.stride()}")  # fmt: skip
    out = torch.empty((rows, out_features), dtype=weight.dtype, device=weight.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(out_features, MERGE_LINEAR_BLOCK_N), rows)
    merge_linear_kernel[grid](
        partial_out, partial_lse, weight, out, out_features, num_heads, num_splits, weight.stride(0), out.stride(0),
        HEADS_PAD=next_pow2(num_heads), SPLITS_PAD=_splits_pad(num_splits), VALUE_DIM=value_dim, BLOCK_DV=block_dv,
        BLOCK_N=MERGE_LINEAR_BLOCK_N, num_warps=4, **pdl_options(weight.device),
    )  # fmt: skip
    return out


def gated_activation(name: str, gate_up: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up [..., 2I]`` (gate half first; ``interleaved``: gate and up
    features alternate, ``g0, u0, g1, u1, ...``) -> ``[..., I]``."""
    width = gate_up.shape[-1]
    inter = width // 2
    rows_in = gate_up.reshape(-1, width)
    out = torch.empty((rows_in.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows_in.shape[0]:
        block = min(1024, next_pow2(inter))
        grid = (rows_in.shape[0], -(-inter // block))
        gated_activation_kernel[grid](
            rows_in, out, inter, rows_in.stride(0), out.stride(0),
            ACT=ACTIVATION_CODES[name], BLOCK=block, INTERLEAVED=interleaved, num_warps=4,
            **pdl_options(gate_up.device),
        )  # fmt: skip
    return out.view(*gate_up.shape[:-1], inter)


def gated_activation_fp8(
    name: str, gate_up: torch.Tensor, interleaved: bool, dtype: torch.dtype, fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_rows(gated_activation(name, gate_up, interleaved), ...)`` in one launch: ``gate_up [T, 2I]``
    (rows' elements contiguous) -> ``(q [T, I] in dtype, scale [T, 1] float32)``, the same values; the
    activation's rows are not written."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=dtype, device=gate_up.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows:
        one_block = next_pow2(inter) <= GATED_FP8_ONE_BLOCK
        block = next_pow2(inter) if one_block else GATED_FP8_BLOCK
        gated_activation_fp8_kernel[(rows,)](
            gate_up, out, scale, inter, gate_up.stride(0), out.stride(0), ACT=ACTIVATION_CODES[name], BLOCK=block,
            FP8_MAX=fp8_max, MIN_SCALE=min_scale, INTERLEAVED=interleaved, ONE_BLOCK=one_block,
            num_warps=max(4, min(16, block // 1024)), **pdl_options(gate_up.device),
        )  # fmt: skip
    return out, scale


# quantize_fp8_rows: features a loop step (a row's two passes over its features run in one program).
FP8_QUANT_BLOCK = 1024
# gated_activation_fp8: rows of up to this many features (a power of two) in registers, one read; wider ones
# in two passes of GATED_FP8_BLOCK features a step.
GATED_FP8_ONE_BLOCK = 16384
GATED_FP8_BLOCK = 2048


def quantize_fp8_rows(
    x: torch.Tensor, dtype: torch.dtype, fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, K], scale [T, 1])``: each row of ``x [T, K]`` (elements contiguous) quantized to ``dtype`` with
    its own scale, ``scale = max(amax(|row|) / fp8_max, min_scale)`` (float32) and ``q = clamp(row / scale,
    -fp8_max, fp8_max)``, as :func:`portattn.models.layers.fp8_linear.quantize_rows` computes it."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(FP8_QUANT_BLOCK, next_pow2(cols))
        quantize_rows_kernel[(rows,)](
            x, out, scale, cols, x.stride(0), out.stride(0), FP8_MAX=fp8_max, MIN_SCALE=min_scale, BLOCK=block,
            num_warps=4 if block >= 512 else 1, **pdl_options(x.device),
        )  # fmt: skip
    return out, scale


@dataclasses.dataclass(frozen=True)
class RotaryTiles:
    """:func:`rotary_kv_write`'s programs: tokens and heads (of one kind) a program, and its warps."""

    block_t: int = 1
    block_h: int = 1
    num_warps: int = 1

    def __post_init__(self):
        for name in ("block_t", "block_h", "num_warps"):
            n = getattr(self, name)
            if not isinstance(n, int) or n < 1 or n & (n - 1):
                raise ValueError(f"expected RotaryTiles.{name} a power of two, got {n!r}")


# Tokens a program from this many tokens on (below: ROTARY_SMALL_BLOCK_T), one head and four warps. On an
# H200 at Llama-3-8B's heads (`scripts/kernels_probe.py rotary`, benchmarks/results/round12_h200): 16 tokens
# 0.112 ms at 16,384 tokens (86% of copy; one token and one head a program with one warp: 0.949 ms, 10%),
# 0.0129 ms at 2,048 (8 tokens 0.0155); 8 tokens 0.0023 ms at 256 (one and one: 0.0155).
ROTARY_LARGE_TOKENS = 2048
ROTARY_SMALL_BLOCK_T = 8
ROTARY_LARGE_BLOCK_T = 16


def rotary_tiles(num_tokens: int) -> RotaryTiles:
    """:func:`rotary_kv_write`'s programs for ``num_tokens`` tokens: 8 tokens of one head with four warps,
    16 from ``ROTARY_LARGE_TOKENS`` tokens on (two compiled variants for every count)."""
    block_t = ROTARY_LARGE_BLOCK_T if num_tokens >= ROTARY_LARGE_TOKENS else ROTARY_SMALL_BLOCK_T
    return RotaryTiles(block_t, 1, 4)


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    tiles: RotaryTiles | None = None,
) -> torch.Tensor:
    """Rotated queries ``[T, Hq, D]`` (a new tensor); rotated keys and the values go to cache ``slots``.

    ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` (heads and tokens may be strided, the
    last dim contiguous); ``cos, sin [T, D]`` (any leading strides; rows of the rotate-half
    embedding, in q's dtype); ``k_cache [N, P, Hkv, D]`` and ``v_cache [N, P, Hkv, Dv]`` contiguous;
    ``slots [T]`` int64 (``page * P + offset``). ``tiles``: tokens and heads a program and its warps
    (default :func:`rotary_tiles`).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, value_dim = v.shape[1], v.shape[2]
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"expected {name} with a contiguous last dim, got strides {t.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("expected contiguous k_cache and v_cache (a slot is page * P + offset), got strided ones")
    tiles = tiles or rotary_tiles(num_tokens)
    heads = triton.cdiv(num_q_heads, tiles.block_h) + 2 * triton.cdiv(num_kv_heads, tiles.block_h)
    grid = (triton.cdiv(num_tokens, tiles.block_t), heads)
    rotary_kv_write_kernel[grid](
        q, k, v, cos, sin, slots, out, k_cache, v_cache, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK=next_pow2(head_dim // 2), VALUE_DIM=value_dim, BLOCK_V=next_pow2(value_dim),
        BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h, num_warps=tiles.num_warps, **pdl_options(q.device),
    )  # fmt: skip
    return out


# Tokens a program of rotary_table.
ROTARY_TABLE_BLOCK_T = 16


def rotary_table(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, D]`` in ``dtype`` (``D = 2 * len(inv_freq)``) of the rotate-half embedding at
    integer ``positions [T]``, in one launch: ``RotaryEmbedding.cos_sin`` of ``positions * inv_freq``
    (``inv_freq`` float32 on the positions' device)."""
    if positions.dim() != 1 or positions.dtype.is_floating_point:
        raise ValueError(f"expected integer positions [T], got {positions.dtype} {tuple(positions.shape)}")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not inv_freq.is_contiguous():
        raise ValueError(
            f"expected a contiguous float32 inv_freq [D / 2], got {inv_freq.dtype} {tuple(inv_freq.shape)}"
        )
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((num_tokens, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens:
        rotary_table_kernel[(triton.cdiv(num_tokens, ROTARY_TABLE_BLOCK_T),)](
            positions, inv_freq, cos, sin, num_tokens, float(scaling), positions.stride(0), cos.stride(0),
            sin.stride(0), HALF=half, BLOCK_T=ROTARY_TABLE_BLOCK_T, BLOCK=next_pow2(half),
            LIBDEVICE=not is_triton_interpreter(), num_warps=4,
            **pdl_options(positions.device),
        )  # fmt: skip
    return cos, sin


def rotary_pairs(
    q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor, eps: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's rotation of consecutive pairs of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by the complex
    table ``freqs_cis [T, D / 2]`` (``InterleavedRotaryEmbedding.table``), and with ``eps`` each head's
    RMS norm without a weight after it (``l2_norm``), in one launch where torch's code takes about
    twenty: new contiguous ``(q, k)`` of the same values (float32 inside, rounded to the dtype where
    the torch code rounds)."""
    tokens, q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != head_dim or k.dtype != q.dtype or head_dim % 2:
        raise ValueError(f"expected q [T, Hq, D] and k [T, Hkv, D] of one dtype and an even D, got {q.dtype} "
                         f"{tuple(q.shape)} and {k.dtype} {tuple(k.shape)}")  # fmt: skip
    if freqs_cis.dtype != torch.complex64 or freqs_cis.shape != (tokens, head_dim // 2):
        raise ValueError(f"expected a complex64 table [{tokens}, {head_dim // 2}], got {freqs_cis.dtype} "
                         f"{tuple(freqs_cis.shape)}")  # fmt: skip
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("expected q and k with a contiguous last dim")
    freqs = torch.view_as_real(freqs_cis.contiguous())  # [T, D / 2, 2] float32
    q_out, k_out = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    if tokens:
        rotary_pairs_kernel[(tokens, q_heads + k.shape[1])](
            q, k, freqs, q_out, k_out, 0.0 if eps is None else float(eps), q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), freqs.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            NUM_Q_HEADS=q_heads, HALF=head_dim // 2, BLOCK=next_pow2(head_dim // 2), NORM=eps is not None,
            num_warps=1, **pdl_options(q.device),
        )  # fmt: skip
    return q_out, k_out


def latent_rotary_write(
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    latent: torch.Tensor,
    slots: torch.Tensor,
    *,
    interleave: bool,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Multi-head latent attention's rope and cache write in one launch (about twenty in the torch
    code): rotated ``q_pe [T, H, Dr]`` (a new contiguous tensor), and ``[c_kv | rotated k_pe]`` (``c_kv
    [T, R]``, ``k_pe [T, Dr]``) stored in rows ``slots [T]`` of ``latent [N, P, R + Dr]`` (contiguous,
    of q's dtype). ``interleave``: pairs rotated by ``cos, sin [T, Dr / 2]`` and written back as
    ``[evens | odds]``; else rotate-half by ``cos, sin [T, Dr]`` (``PartialRotaryEmbedding.table``).
    The values of ``PartialRotaryEmbedding.apply`` and ``AttentionBackend.write_latent``. With
    ``norm_weight [R]`` (of q's dtype), ``c_kv`` is stored through that RMSNorm (``eps``), as
    ``RMSNorm`` (Llama's rounding) then the write would store it: one launch a layer fewer."""
    tokens, heads, rope_dim = q_pe.shape
    rank = c_kv.shape[-1]
    half = rope_dim // 2
    table = half if interleave else rope_dim
    if (c_kv.shape != (tokens, rank) or k_pe.shape != (tokens, rope_dim) or rope_dim % 2
            or len({q_pe.dtype, c_kv.dtype, k_pe.dtype, cos.dtype, sin.dtype, latent.dtype}) != 1):  # fmt: skip
        raise ValueError(f"expected q_pe [T, H, Dr], c_kv [T, R], k_pe [T, Dr] (Dr even), tables and a latent cache "
                         f"of one dtype, got {tuple(q_pe.shape)} {q_pe.dtype}, {tuple(c_kv.shape)} {c_kv.dtype}, "
                         f"{tuple(k_pe.shape)} {k_pe.dtype}, tables {cos.dtype}, cache {latent.dtype}")  # fmt: skip
    if cos.shape != (tokens, table) or sin.shape != (tokens, table):
        raise ValueError(f"expected cos and sin [{tokens}, {table}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if latent.shape[-1] != rank + rope_dim or not latent.is_contiguous():
        raise ValueError(f"expected a contiguous latent cache [N, P, {rank + rope_dim}], got {tuple(latent.shape)}")
    if any(t.stride(-1) != 1 for t in (q_pe, c_kv, k_pe, cos, sin)):
        raise ValueError("expected q_pe, c_kv, k_pe, cos and sin with a contiguous last dim")
    if norm_weight is not None and (norm_weight.shape != (rank,) or norm_weight.dtype != q_pe.dtype
                                    or not norm_weight.is_contiguous()):  # fmt: skip
        raise ValueError(f"expected a contiguous norm weight [{rank}] of dtype {q_pe.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")  # fmt: skip
    out = torch.empty((tokens, heads, rope_dim), dtype=q_pe.dtype, device=q_pe.device)
    if tokens:
        latent_rotary_write_kernel[(tokens, heads + 1)](
            q_pe, c_kv, k_pe, cos, sin, slots, out, latent, c_kv if norm_weight is None else norm_weight, eps,
            q_pe.stride(0), q_pe.stride(1), c_kv.stride(0),
            k_pe.stride(0), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1), latent.shape[-1],
            NUM_HEADS=heads, RANK=rank, BLOCK_R=next_pow2(rank), HALF=half, BLOCK=next_pow2(half),
            INTERLEAVE=interleave, NORM=norm_weight is not None, num_warps=1, **pdl_options(q_pe.device),
        )  # fmt: skip
    return out


def grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    num_groups: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V3's grouped top-k routing (``DeepseekV3Router``) of float32 router logits ``[T, E]`` and
    the choice bias ``[E]``, in one launch: ``(weights [T, top_k] float32, ids [T, top_k] int64)``, the
    experts largest choice first (the lowest index among equal choices)."""
    tokens, experts = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32 or bias.shape != (experts,):
        raise ValueError(f"expected float32 logits [T, E] and bias [E], got {logits.dtype} {tuple(logits.shape)} "
                         f"and {bias.dtype} {tuple(bias.shape)}")  # fmt: skip
    per = experts // max(num_groups, 1)
    if num_groups < 1 or per * num_groups != experts or per < 2 or not 1 <= topk_group <= num_groups:
        raise ValueError(f"expected {experts} experts in num_groups groups of 2 or more and topk_group in "
                         f"[1, num_groups], got num_groups={num_groups}, topk_group={topk_group}")  # fmt: skip
    if not 1 <= top_k <= topk_group * per:
        raise ValueError(f"expected top_k in [1, {topk_group * per}] (the kept groups' experts), got {top_k}")
    if logits.stride(-1) != 1 or not bias.is_contiguous():
        raise ValueError("expected logits with a contiguous last dim and a contiguous bias")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    # In a compile-ahead rehearsal nothing launches and a prefill's expert counts read the ids: zeros then.
    ids = (torch.zeros if compile_ahead.rehearsing() else torch.empty)((tokens, top_k), dtype=torch.int64,
                                                                         device=logits.device)  # fmt: skip
    if tokens:
        grouped_topk_kernel[(tokens,)](
            logits, bias, weights, ids, logits.stride(0), float(scaling), NUM_EXPERTS=experts, NUM_GROUPS=num_groups,
            GROUPS=next_pow2(num_groups), PER_GROUP=next_pow2(per), TOPK_GROUP=topk_group, TOP_K=top_k,
            SLOTS=next_pow2(top_k), NORMALIZE=normalize, num_warps=4, **pdl_options(logits.device),
        )  # fmt: skip
    return weights, ids


# router_topk: tokens a step takes it for at most, experts at most, features a tile step and a program.
ROUTER_TOPK_TOKENS = 64
ROUTER_TOPK_EXPERTS = 128
ROUTER_TOPK_BLOCK_K = 256
ROUTER_TOPK_SPLIT_K = 512
_router_counters: dict[torch.device, torch.Tensor] = {}


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's router (``Llama4MoE``: ``topk(x @ weight.T)`` and the sigmoid of the chosen logits) of rows
    ``x [T, K]`` over ``weight [E, K]`` (x's dtype, float16 or bfloat16) in one launch: ``(scores [T, top_k]``
    in x's dtype, ``ids [T, top_k]`` int64), the largest logit first (the lowest expert among equal logits). The
    logits are summed in float32 and rounded to x's dtype as ``F.linear``'s are. For ``T <=
    ROUTER_TOPK_TOKENS`` and ``E <= ROUTER_TOPK_EXPERTS``: programs of ``ROUTER_TOPK_SPLIT_K`` features, the
    token's last one choosing (a counter a token, kept zero between launches, per device)."""
    tokens, in_features = x.shape
    experts = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != in_features or weight.dtype != x.dtype:
        raise ValueError(f"expected a router weight [E, {in_features}] of {x.dtype}, got {weight.dtype} "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if not 1 <= top_k <= experts or experts > ROUTER_TOPK_EXPERTS or tokens > ROUTER_TOPK_TOKENS:
        raise ValueError(f"expected top_k in [1, {experts}] of at most {ROUTER_TOPK_EXPERTS} experts and at most "
                         f"{ROUTER_TOPK_TOKENS} tokens, got top_k {top_k} of {experts}, {tokens} tokens")  # fmt: skip
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("expected x and the weight with a contiguous last dim")
    scores = torch.empty((tokens, top_k), dtype=x.dtype, device=x.device)
    # In a compile-ahead rehearsal nothing launches and a prefill's expert counts read the ids: zeros then.
    ids = (torch.zeros if compile_ahead.rehearsing() else torch.empty)((tokens, top_k), dtype=torch.int64,
                                                                         device=x.device)  # fmt: skip
    if tokens:
        counters = _router_counters.get(x.device)
        if counters is None:
            counters = _router_counters[x.device] = torch.zeros(ROUTER_TOPK_TOKENS, dtype=torch.int32, device=x.device)
        splits, block_e = triton.cdiv(in_features, ROUTER_TOPK_SPLIT_K), next_pow2(experts)
        partials = torch.empty((tokens, splits, block_e), dtype=torch.float32, device=x.device)
        router_topk_kernel[(tokens, splits)](
            x, weight, partials, counters, scores, ids, in_features, x.stride(0), weight.stride(0),
            NUM_EXPERTS=experts, BLOCK_E=block_e, BLOCK_K=ROUTER_TOPK_BLOCK_K, SPLIT_K=ROUTER_TOPK_SPLIT_K,
            NUM_SPLITS=splits, BLOCK_S=next_pow2(splits), TOP_K=top_k, SLOTS=next_pow2(top_k), num_warps=4,
            **pdl_options(x.device),
        )  # fmt: skip
    return scores, ids


def kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """``k [T, Hkv, D]`` and ``v [T, Hkv, Dv]`` (heads and tokens may be strided, the last dim contiguous) into
    slots ``slots [T]`` (``page * P + offset``) of the contiguous caches ``k_cache [N, P, Hkv, D]`` and ``v_cache
    [N, P, Hkv, Dv]`` of their dtype, in one launch (``AttentionBackend.write_kv`` of such a cache)."""
    tokens, heads, head_dim = k.shape
    value_dim = v.shape[2]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("expected k and v with a contiguous last dim and contiguous caches")
    if tokens:
        kv_write_kernel[(tokens, heads)](
            k, v, slots, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
            HEAD_DIM=head_dim, VALUE_DIM=value_dim, BLOCK_D=next_pow2(head_dim), BLOCK_V=next_pow2(value_dim),
            num_warps=1, **pdl_options(k.device),
        )  # fmt: skip


ATTN_TEMPERATURE_BLOCK = 1024


def attn_temperature(q: torch.Tensor, positions: torch.Tensor, attn_scale: float, floor_scale: float) -> torch.Tensor:
    """Llama 4's attention temperature (NoPE layers, ``attn_temperature_tuning``) in one launch: a new
    ``q [T, Hq, D]`` (a contiguous copy) of ``(q * s).to(q.dtype)``, ``s = log1p(floor((positions + 1) /
    floor_scale)) * attn_scale + 1`` in float32 for integer ``positions [T]``."""
    tokens = q.shape[0]
    if positions.shape != (tokens,) or positions.dtype.is_floating_point:
        raise ValueError(f"expected integer positions [{tokens}], got {positions.dtype} {tuple(positions.shape)}")
    rows = q.reshape(tokens, -1)
    if rows.stride(-1) != 1:
        raise ValueError(f"expected q with each token's values contiguous, got strides {q.stride()}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    width = rows.shape[1]
    if tokens:
        attn_temperature_kernel[(tokens, triton.cdiv(width, ATTN_TEMPERATURE_BLOCK))](
            rows, positions, out, float(attn_scale), float(floor_scale), rows.stride(0), width,
            WIDTH=width, BLOCK=ATTN_TEMPERATURE_BLOCK, LIBDEVICE=not is_triton_interpreter(), num_warps=4,
            **pdl_options(q.device),
        )  # fmt: skip
    return out


def argmax_rows(
    scores: torch.Tensor, out: torch.Tensor, *, copy_into: torch.Tensor | None = None, chunk: int = 4096
) -> torch.Tensor:
    """``out [N]`` int64 := ``torch.argmax(scores, dim=-1)`` for ``scores [N, V]`` float32 (rows with a
    contiguous last dim), in two launches (``kernels/triton/argmax.py``); ``copy_into`` (``[N, V]``
    float32, same layout): also receives the scores."""
    rows, vocab = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"expected float32 scores [N, V] with a contiguous last dim, got {scores.dtype} "
                         f"strides {scores.stride()}")  # fmt: skip
    if out.shape != (rows,) or out.dtype != torch.int64 or (rows > 1 and out.stride(0) != 1):
        raise ValueError(f"expected a contiguous int64 out [{rows}], got {out.dtype} {tuple(out.shape)}")
    if copy_into is not None and (
        copy_into.shape != scores.shape or copy_into.dtype != torch.float32 or copy_into.stride(-1) != 1
    ):
        raise ValueError(f"expected copy_into float32 {tuple(scores.shape)}, got {copy_into.dtype} "
                         f"{tuple(copy_into.shape)}")  # fmt: skip
    chunk = min(chunk, next_pow2(vocab))
    num_chunks = -(-vocab // chunk)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=scores.device)
    best_token = torch.empty((rows, num_chunks), dtype=torch.int32, device=scores.device)
    if rows:
        options = pdl_options(scores.device)
        argmax_chunks_kernel[(rows, num_chunks)](
            scores, scores if copy_into is None else copy_into, best, best_token, vocab, scores.stride(0),
            0 if copy_into is None else copy_into.stride(0), num_chunks,
            CHUNK=chunk, COPY=copy_into is not None, num_warps=8, **options,
        )  # fmt: skip
        argmax_merge_kernel[(rows,)](
            best, best_token, out, num_chunks, BLOCK_C=next_pow2(num_chunks), num_warps=1, **options
        )
    return out


def gumbel_max(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    row_words: torch.Tensor,
    greedy: torch.Tensor,
    *,
    divide: bool,
    chunk: int = 4096,
    block: int = 1024,
) -> torch.Tensor:
    """``tokens [N]`` int64: per row of ``scores [N, V]`` float32 (rows contiguous), the argmax of
    ``scores / T - log(-log u)`` with the sampler's variates ``u`` of ``row_words [2, N]``
    (``sampler.row_words``), or of the raw scores on ``greedy`` rows; ``divide=False``: the scores
    are already divided by ``temperature [N]``. The sampler's draw, without ``[N, V]`` of noise."""
    rows, vocab = scores.shape
    block = min(block, next_pow2(vocab))
    chunk = max(block, min(chunk, next_pow2(vocab)))
    num_chunks = -(-vocab // chunk)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=scores.device)
    best_token = torch.empty((rows, num_chunks), dtype=torch.int32, device=scores.device)
    if rows:
        gumbel_max_kernel[(rows, num_chunks)](
            scores, temperature, row_words, greedy, best, best_token, vocab, scores.stride(0), rows, num_chunks,
            DIVIDE=divide, BLOCK=block, CHUNK=chunk, num_warps=4,
        )  # fmt: skip
    first_best = best.argmax(dim=1, keepdim=True)  # [N, 1]: the first chunk with the row's best score
    return best_token.gather(1, first_best)[:, 0].long()


def nucleus(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    row_words: torch.Tensor,
    greedy: torch.Tensor,
    *,
    divide: bool,
    rounds: int,
    block: int = 4096,
    top_k: torch.Tensor | None = None,
    top_k_cap: int = TOP_K_CAP,
) -> torch.Tensor:
    """``tokens [N]`` int64: per row of ``scores [N, V]`` float32 (rows contiguous), a sample of the
    nucleus of ``top_p [N]`` (1: the whole distribution) by rejection (``kernels/triton/nucleus.py``),
    with the sampler's variates of ``row_words [2, N]``; the argmax on ``greedy`` rows. ``divide``: the
    scores are raw logits, divided by ``temperature [N]`` first. ``rounds``: draws before a row takes
    its top token. ``top_k [N]`` int64 (V or more: every token): the nucleus of the tokens scoring at
    least the row's k-th largest score: for k up to ``top_k_cap`` taken from ``torch.topk`` here, for
    larger k searched in the kernel."""
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    floor = None
    if top_k is not None and min(top_k_cap, vocab) > 0:
        floor, top_k = top_k_floor(scores, top_k, min(top_k_cap, vocab))
    if rows:
        nucleus_kernel[(rows,)](
            scores, temperature, top_p, out if top_k is None else top_k, out if floor is None else floor,
            row_words, greedy, out, vocab, scores.stride(0), rows,
            DIVIDE=divide, ROUNDS=rounds, BLOCK=min(block, next_pow2(vocab)), HAS_TOP_K=top_k is not None,
            HAS_FLOOR=floor is not None, num_warps=8,
        )  # fmt: skip
    return out


def top_k_floor(scores: torch.Tensor, top_k: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(floor [N] float32, top_k [N])``: each row's k-th largest score where ``top_k <= cap < V``
    (-inf elsewhere) from one ``torch.topk`` of ``cap`` scores a row, and ``top_k`` with those rows
    set to V (the kernel searches only the rest). Static shapes: capturable in a graph."""
    vocab = scores.shape[-1]
    largest = torch.topk(scores, cap, dim=-1).values  # [N, cap], descending
    kth = largest.gather(1, (top_k.clamp(1, cap) - 1)[:, None])[:, 0]
    found = top_k <= cap
    floor = torch.where(found & (top_k < vocab), kth, float("-inf"))
    return floor, torch.where(found, vocab, top_k)
