"""Linear layers whose parameters are filled by the checkpoint loader through ``weight_loader``.

Every parameter carries ``weight_loader(param, loaded_tensor[, shard])``: the loader
(:mod:`portattn.models.loader`) hands it each checkpoint tensor that maps to the parameter and the
parameter copies what it owns. A plain linear copies the whole tensor; a merged linear (several
projections of one input in one matmul: q/k/v, gate/up) copies each checkpoint tensor into its rows.
Sharded (tensor-parallel) or quantized variants override the same hook to slice or convert.

Parameters are created with ``torch.empty`` on the current default device and dtype (the loader
builds models under ``torch.device(device)`` and the model dtype), so construction costs no
initialisation and no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape differs from the parameter (or shard) it loads into."""

    def __init__(self, want: Sequence[int], got: Sequence[int]):
        self.want, self.got = list(want), list(got)
        super().__init__(f"expected shape {self.want}, got {self.got}")


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (casting to ``dst``'s dtype) after checking the shapes agree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(dst.shape, src.shape)
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """The whole tensor into the whole parameter."""
    copy_checked(param.data, loaded)


def new_parameter(*shape: int, dtype: torch.dtype | None = None, loader=None, shards=None) -> nn.Parameter:
    """An uninitialised, frozen parameter with its ``weight_loader`` (and, for merged ones, its ``shards``)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader if loader is not None else default_weight_loader
    param.shards = tuple(shards) if shards is not None else None  # checkpoint tensors that make it up
    return param


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W [out_features, in_features]`` (parameter names as ``nn.Linear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = new_parameter(out_features, in_features, dtype=dtype, loader=self.weight_loader)
        self.bias = new_parameter(out_features, dtype=dtype, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Projections of the same input concatenated on the output dim, computed in one matmul.

    ``output_sizes[i]`` rows belong to shard ``shard_ids[i]`` (default ``0, 1, ...``); the
    checkpoint keeps one tensor per shard, loaded with ``weight_loader(param, tensor, shard_id)``.
    :meth:`split` cuts an output back into the shards' parts.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        shard_ids: Sequence[object] | None = None,
        dtype: torch.dtype | None = None,
    ):
        shard_ids = list(range(len(output_sizes))) if shard_ids is None else list(shard_ids)
        if len(shard_ids) != len(output_sizes):
            raise ValueError(f"expected one shard id per output size {list(output_sizes)}, got {shard_ids}")
        super().__init__(in_features, sum(output_sizes), bias, dtype=dtype)
        self.output_sizes = list(output_sizes)
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        self.rows = {sid: (offsets[i], offsets[i + 1]) for i, sid in enumerate(shard_ids)}
        for param in (self.weight, self.bias):
            if param is not None:
                param.shards = tuple(shard_ids)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id not in self.rows:
            raise ValueError(f"expected a shard in {list(self.rows)}, got {shard_id!r}")
        start, end = self.rows[shard_id]
        copy_checked(param.data[start:end], loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y [..., sum(output_sizes)]`` -> one view per shard, in order."""
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """The query, key and value projections of one attention layer (shards ``"q"``, ``"k"``, ``"v"``)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False, *, dtype=None
    ):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_ids=("q", "k", "v"), dtype=dtype)
