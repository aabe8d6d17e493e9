"""Linear layers in fp8 (``quantization="fp8"``): weights quantized once after loading, activations at each
forward, the matmul on the fp8 tensor cores (``torch._scaled_mm`` with row-wise scales).

Each weight ``W [N, K]`` becomes float8 e4m3 with one float32 scale per output feature (``W[n] ~ weight[n] *
weight_scale[n]``, ``weight_scale[n] = amax(|W[n]|) / 448``), and each input row (a token) is quantized the
same way when the layer runs, with its own scale (dynamic, per token): a token's scale does not depend on
its batch-mates (one scale for the whole batch made the real model answer in gibberish beside other
prompts). The product ``(x_q W_q^T)[t, n] * x_scale[t] * weight_scale[n]`` accumulates in
float32 and comes out in bfloat16 on GPUs (what the row-wise fp8 matmul writes; cast to a float16 or float32
model's dtype after it), in the model's dtype elsewhere; a bias is added after it. On GPUs the input's
quantization is one Triton launch (:func:`~portattn.kernels.triton.fused_launch.quantize_fp8_rows`),
elsewhere :func:`quantize_rows`' torch code. In steps of more than one row on GPUs the launch before a
projection quantizes its rows instead (:class:`FP8Rows`): the norms before the q/k/v and gate/up projections
(``RMSNorm.quantized``) and the gated activation before the down projection (``GatedMLP``, through
``fused_launch.gated_activation_fp8``), so that those rows are not written in 16 bits and read back.

What is quantized: the :class:`~.linear.Linear` layers of the decoder (attention's q/k/v and output
projections, the MLP's gate/up and down projections, an MLA's down projections), whose input and output
features are multiples of 16 (what the fp8 matmul takes). What keeps the model's dtype: the embedding and
the LM head, the norms, routers and mixtures' experts, MLA's ``kv_b_proj`` (its weight is absorbed into the
attention), vision encoders; a module marks itself with ``quantizable = False`` (for itself and what it
holds). Steps of up to 16 rows take the fused small-batch launches instead where the 16-bit weights would
(``norm_linear``, ``row_linear``: the norm and gated activation folded into the projections), over the fp8
weight and its scales with the rows not quantized; the backend's projecting launches (q/k/v with its
rotation and cache write) take 16-bit weights only.

Costs and effects (measured on an H200, ``benchmarks/results/engine_h200/round30/NOTES.md``): the weights'
bytes halve and matmuls of thousands of rows run about 1.7x faster than in bfloat16; a batch-1 decode step
is slower (5.05 against 4.32 ms on the 8B shape: the one-row launches are not faster over fp8 weights yet).
Outputs differ from the 16-bit model's within fp8's precision (about 4% relative error a product), and by
path: steps that take the fused launches do not quantize their rows; the real model's perplexity and
answers are tested (``tests/models/test_gguf.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fused import fused_ops

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest scale: an all-zero tensor quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12
# Above this many rows the fp8 matmul keeps its sums in the tensor cores' accumulator (``use_fast_accum``), as
# vLLM's CUTLASS fp8 GEMM on sm_90 does above 128 rows.
FAST_ACCUM_ABOVE_ROWS = 128


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale [R, 1])``: each row of ``t [R, C]`` in float8 e4m3 with its own float32 scale, ``scale =
    max(amax(|row|) / 448, MIN_SCALE)``, ``q = clamp(row / scale, -448, 448)`` rounded to nearest (the
    reference of the GPU launch)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    # Divided by a tensor: by a Python number, CUDA multiplies by its reciprocal (not the kernel's IEEE division).
    scale = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=MIN_SCALE)
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``x [T, K]`` (elements contiguous), in one Triton launch on GPUs."""
    ops = fused_ops(x)
    if ops is None:
        return quantize_rows(x)
    return ops.quantize_fp8_rows(x, FP8_DTYPE, FP8_MAX, MIN_SCALE)


class FP8Rows(NamedTuple):
    """A linear layer's input rows already quantized (:func:`quantize_rows`' pair, made by the launch before
    the layer: the norm's or the gated activation's) and the dtype the product comes out in."""

    q: torch.Tensor  # [T, K] float8 e4m3
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype


def fp8_linear(
    x: torch.Tensor | FP8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b`` with ``W[n] ~ weight[n] * weight_scale[0, n]`` (``weight [N, K]`` float8, ``weight_scale
    [1, N]``) and ``x`` quantized per row: ``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype (or rows quantized
    already, :class:`FP8Rows` ``[T, K]`` -> ``[T, N]`` in their ``dtype``)."""
    if isinstance(x, FP8Rows):
        (q, scale), dtype, lead = x[:2], x.dtype, x.q.shape[:-1]
    else:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], weight.shape[0])
        q, scale = quantize_input(rows if rows.stride(-1) == 1 else rows.contiguous())
        dtype, lead = x.dtype, x.shape[:-1]
    if q.shape[0] == 0:
        return torch.empty((0, weight.shape[0]), dtype=dtype, device=q.device)
    out_dtype = torch.bfloat16 if q.device.type == "cuda" else dtype  # row-wise scales: bfloat16 out on GPUs
    fast = q.shape[0] > FAST_ACCUM_ABOVE_ROWS  # (a GPU's fp8 MMA sums in its own precision; the CPU ignores it)
    y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype, use_fast_accum=fast)
    y = y.to(dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])
