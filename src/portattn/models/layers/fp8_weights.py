"""FP8 weight checkpoints (``quantization_config.quant_method == "fp8"``), dequantized at load time into
the model's dtype.

Two layouts, as DeepSeek-V3 / R1, Qwen3 "-FP8" and the per-tensor FP8 checkpoints store them:

* block-wise (``weight_block_size = [bm, bn]``): each quantized ``X.weight [R, C]`` (float8) comes with
  ``X.weight_scale_inv [ceil(R / bm), ceil(C / bn)]`` (float32); ``W[r, c] = weight[r, c] *
  weight_scale_inv[r // bm, c // bn]``. The last block row and column may be partial.
* per-tensor (no ``weight_block_size``): ``X.weight_scale``, one float32 value; ``W = weight * scale``.
  Activation scales (``X.input_scale``) are not used: activations stay in the model's dtype.

Weights without a scale tensor (norms, embeddings, modules left unquantized) load as they are. A
quantized weight reaches its parameter's ``weight_loader`` as a :class:`DequantizedSlice`, which narrows
like any :class:`~.linear.CheckpointSlice` (a tensor-parallel rank reads only its rows or columns and the
scale blocks they fall in) and dequantizes, in float32, the part it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...errors import expect, is_int
from .linear import CheckpointSlice

FP8_SAFETENSORS_DTYPES = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class FP8Weights:
    """How a checkpoint's fp8 weights are scaled: ``block`` ``(bm, bn)``, or None for one scale per tensor."""

    block: tuple[int, int] | None

    @classmethod
    def from_config(cls, quant: dict) -> FP8Weights:
        block = quant.get("weight_block_size")
        if block is None:
            return cls(None)
        ok = isinstance(block, (list, tuple)) and len(block) == 2 and all(is_int(b) and b >= 1 for b in block)
        expect(ok, "weight_block_size [rows, cols] of positive ints", block)
        return cls((int(block[0]), int(block[1])))

    @property
    def scale_suffix(self) -> str:
        return "_scale_inv" if self.block is not None else "_scale"

    def scale_key(self, key: str) -> str | None:
        """The scale tensor's name of weight ``key`` (``X.weight`` -> ``X.weight_scale_inv``)."""
        return key + self.scale_suffix if key.endswith(".weight") else None

    def is_side_tensor(self, key: str) -> bool:
        """A scale (read with its weight) or an activation scale (not used)."""
        return key.endswith((".weight" + self.scale_suffix, ".input_scale"))


class DequantizedSlice(CheckpointSlice):
    """An fp8 weight ``[R, C]`` not read yet, with its scales: :meth:`read` returns the dequantized
    float32 values of the part it covers."""

    def __init__(
        self,
        source,
        shape: Sequence[int],
        scale: Callable[[], torch.Tensor],
        block: tuple[int, int] | None,
        index: tuple[slice, ...] | None = None,
    ):
        super().__init__(source, shape, index)
        self.scale, self.block = scale, block

    def narrow(self, dim: int, start: int, length: int) -> DequantizedSlice:
        part = super().narrow(dim, start, length)
        return DequantizedSlice(part.source, part.shape, self.scale, self.block, part.index)

    def read(self) -> torch.Tensor:
        weight = super().read().to(torch.float32)
        scale = self.scale().to(torch.float32)
        if self.block is None:
            return weight * scale.reshape(())
        (rows, cols), (bm, bn) = self.index, self.block
        r = torch.arange(rows.start, rows.stop) // bm
        c = torch.arange(cols.start, cols.stop) // bn
        return weight * scale[r[:, None], c[None, :]]


def dequantizing_slice(part, key: str, scale: Callable[[], torch.Tensor], scale_shape, fp8: FP8Weights):
    """A :class:`DequantizedSlice` of the safetensors slice ``part`` (weight ``key``), after checking its
    dtype and its scale's shape."""
    shape = list(part.get_shape())
    expect(part.get_dtype() in FP8_SAFETENSORS_DTYPES, f"{key} in fp8 beside its scale", part.get_dtype())
    expect(len(shape) == 2, f"{key} of two dims (a quantized linear weight)", shape)
    if fp8.block is None:
        expect(list(scale_shape) in ([], [1]), f"{key} with one per-tensor scale", list(scale_shape))
    else:
        (bm, bn), (rows, cols) = fp8.block, shape
        want = [-(-rows // bm), -(-cols // bn)]
        expect(list(scale_shape) == want, f"{key}'s scale blocks of shape {want}", list(scale_shape))
    return DequantizedSlice(part, shape, scale, fp8.block)
