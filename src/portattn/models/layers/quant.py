"""MXFP4 weights (the OCP microscaling format gpt-oss checkpoints store their experts in), dequantized
at load time into the model's dtype.

A quantized matrix ``W [..., rows, cols]`` is stored as two tensors:

* ``blocks [..., rows, cols / 32, 16]`` uint8: 32 FP4 (E2M1) codes per group, two per byte, the low
  nibble first (element ``2i`` of a group is byte ``i & 0x0F``, element ``2i + 1`` is ``byte i >> 4``);
* ``scales [..., rows, cols / 32]`` uint8: one power of two per group, biased by 127
  (the group's values are ``FP4_VALUES[code] * 2 ** (scale - 127)``).

Code ``c`` is the E2M1 number ``FP4_VALUES[c]`` (bit 3 the sign). Every FP4 value times a power of
two is exact in float32 and bfloat16, so dequantization there is exact; in float16 it is exact for
scales within float16's range.
"""

from __future__ import annotations

import torch

from ...errors import expect
from .linear import WeightShapeError

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32  # values per scale
SCALE_BIAS = 127


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    expect(blocks.dtype == torch.uint8, "MXFP4 blocks of dtype torch.uint8", blocks.dtype)
    expect(scales.dtype == torch.uint8, "MXFP4 scales of dtype torch.uint8", scales.dtype)
    expect(
        blocks.dim() >= 2 and blocks.shape[-1] == GROUP_SIZE // 2 and blocks.shape[:-1] == scales.shape,
        f"MXFP4 blocks [..., groups, {GROUP_SIZE // 2}] matching scales {list(scales.shape)}",
        list(blocks.shape),
    )


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8, ``scales [..., G]`` uint8 -> ``W [..., G * 32]`` in ``dtype``
    (or written into ``out``, on its device and in its dtype), computed in float32 on ``out``'s device.

    The values come out in the layout they were stored in (for gpt-oss's experts: ``[E, out, in]``,
    the ``F.linear`` layout).
    """
    check_mxfp4(blocks, scales)
    device = out.device if out is not None else blocks.device
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    codes = blocks.to(device)
    exponents = scales.to(device=device, dtype=torch.int32) - SCALE_BIAS  # [..., G]
    values = torch.stack((lut[(codes & 0x0F).int()], lut[(codes >> 4).int()]), dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), exponents[..., None])  # [..., G, 32], exact in float32
    values = values.flatten(-2)  # [..., G * 32]
    if out is None:
        return values.to(dtype)
    expect(tuple(out.shape) == tuple(values.shape), f"out of shape {list(values.shape)}", list(out.shape))
    out.copy_(values)
    return out


class MXFP4Pairs:
    """Collects each parameter's ``blocks`` and ``scales`` checkpoint tensors (they arrive separately, in
    any order, possibly from different files) and dequantizes into the parameter once both are in."""

    PARTS = ("blocks", "scales")

    def __init__(self):
        self._pending: dict[int, dict[str, torch.Tensor]] = {}

    def add(
        self, param: torch.nn.Parameter, part: str, loaded: torch.Tensor, columns: tuple[int, int] | None = None
    ) -> None:
        """``columns = (start, length)``: the parameter holds only those columns of the dequantized
        matrix (a tensor-parallel share whose edges do not fall on groups of 32)."""
        expect(part in self.PARTS, f"an MXFP4 part in {list(self.PARTS)}", repr(part))
        parts = self._pending.setdefault(id(param), {})
        parts[part] = loaded
        if len(parts) == len(self.PARTS):
            del self._pending[id(param)]
            blocks, scales = parts["blocks"], parts["scales"]
            check_mxfp4(blocks, scales)
            want = tuple(param.shape)
            got = (*scales.shape[:-1], scales.shape[-1] * GROUP_SIZE)
            if columns is not None:
                want = (*want[:-1], got[-1])  # the whole columns are dequantized, then narrowed
            if got != want:
                raise WeightShapeError(want, got)
            for i in range(want[0]):  # one leading slice (one expert) at a time: float32 temporaries stay small
                if columns is None:
                    dequantize_mxfp4(blocks[i], scales[i], out=param.data[i])
                else:
                    param.data[i].copy_(dequantize_mxfp4(blocks[i], scales[i]).narrow(-1, *columns))
