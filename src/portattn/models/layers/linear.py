"""Linear layers whose parameters are filled by the checkpoint loader through ``weight_loader``.

Every parameter carries ``weight_loader(param, loaded[, shard])``: the loader
(:mod:`portattn.models.loader`) hands it each checkpoint tensor that maps to the parameter, as a
:class:`CheckpointSlice` (nothing read yet), and the parameter copies what it owns. A plain linear
copies the whole tensor; a merged linear (several projections of one input in one matmul: q/k/v,
gate/up) copies each checkpoint tensor into its rows.

Tensor parallelism (a :class:`~portattn.distributed.group.TPGroup` of ``size`` ranks) shards the
matmuls the Megatron way: a **column-parallel** linear keeps rank ``r``'s share of the output
features (its rows of ``W``) and leaves its output split; a **row-parallel** linear keeps the matching
share of the input features (columns of ``W``) and all-reduces its partial products. Each rank's
``weight_loader`` narrows the checkpoint tensor to its share before anything is read, so no rank
reads (or holds) a sharded tensor whole. With ``tp=None`` (one process) every layer computes what
``nn.Linear`` computes.

Parameters are created with ``torch.empty`` on the current default device and dtype (the loader
builds models under ``torch.device(device)`` and the model dtype), so construction costs no
initialisation and no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed.group import TPGroup, attention_heads, tp_or_single
from ...quantization import FP8_OUT_DTYPES
from .activation import Activation, gated
from .fp8_linear import fp8_linear, quantize_rows
from .fused import fused_linear_ops


class CheckpointSlice:
    """A checkpoint tensor (or a part of one) not read yet.

    ``source`` is anything indexable by a tuple of slices that returns a tensor: a safetensors
    ``get_slice`` handle (which then reads only the indexed bytes) or a tensor. :meth:`narrow`
    selects a part as ``torch.Tensor.narrow`` does; :meth:`read` reads it. Used where a tensor is
    expected (``param.copy_(loaded)``, ``loaded.t()``), it reads itself first.
    """

    def __init__(self, source, shape: Sequence[int], index: tuple[slice, ...] | None = None):
        self.source = source
        self.shape = torch.Size(shape)
        self.index = index if index is not None else tuple(slice(0, n) for n in self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            size = self.shape[dim]
            raise ValueError(f"expected a range within dim {dim} of size {size}, got [{start}, {start + length})")
        first = self.index[dim].start + start
        index = (*self.index[:dim], slice(first, first + length), *self.index[dim + 1 :])
        return CheckpointSlice(self.source, (*self.shape[:dim], length, *self.shape[dim + 1 :]), index)

    def read(self) -> torch.Tensor:
        return self.source[self.index if self.index else ...]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*_read_all(args), **{k: _read_all(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str):  # any other tensor attribute: read, then ask the tensor
        if name in ("source", "shape", "index"):
            raise AttributeError(name)
        return getattr(self.read(), name)


def _read_all(value):
    if isinstance(value, CheckpointSlice):
        return value.read()
    if isinstance(value, (list, tuple)):
        return type(value)(_read_all(v) for v in value)
    return value


def shard_of(loaded, full_shape: Sequence[int], dim: int, start: int, length: int):
    """``loaded.narrow(dim, start, length)`` after checking ``loaded`` has the full (unsharded) shape."""
    if list(loaded.shape) != list(full_shape):
        raise WeightShapeError(full_shape, loaded.shape)
    return loaded.narrow(dim, start, length)


def as_tensor(loaded: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    """The tensor itself, or the slice read."""
    return loaded.read() if isinstance(loaded, CheckpointSlice) else loaded


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape differs from the parameter (or shard) it loads into."""

    def __init__(self, want: Sequence[int], got: Sequence[int]):
        self.want, self.got = list(want), list(got)
        super().__init__(f"expected shape {self.want}, got {self.got}")


def copy_checked(dst: torch.Tensor, src: torch.Tensor | CheckpointSlice) -> None:
    """``dst.copy_(src)`` (casting to ``dst``'s dtype, reading a slice) after checking the shapes agree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(dst.shape, src.shape)
    dst.copy_(as_tensor(src))


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor | CheckpointSlice) -> None:
    """The whole tensor into the whole parameter."""
    copy_checked(param.data, loaded)


def new_parameter(*shape: int, dtype: torch.dtype | None = None, loader=None, shards=None) -> nn.Parameter:
    """An uninitialised, frozen parameter with its ``weight_loader`` (and, for merged ones, its ``shards``)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader if loader is not None else default_weight_loader
    param.shards = tuple(shards) if shards is not None else None  # checkpoint tensors that make it up
    return param


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W [out_features, in_features]`` (parameter names as ``nn.Linear``);
    replicated: every rank holds and computes all of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = new_parameter(out_features, in_features, dtype=dtype, loader=self.weight_loader)
        self.bias = new_parameter(out_features, dtype=dtype, loader=self.weight_loader) if bias else None
        # Its per-row float32 scales [1, N] once the weight is quantized to fp8 (quantize_linears), else None.
        self.register_buffer("weight_scale", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        copy_checked(param.data, loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``, in fp8 where the weight is quantized (:mod:`.fp8_linear`)."""
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(Linear):
    """:class:`Linear` with its ``out_features`` split over the ranks: rank ``r`` holds rows
    ``[r * out / size, (r + 1) * out / size)`` of ``W`` and ``b``, and returns ``[..., out / size]``
    (its part of the output, not gathered). ``out_features`` is the full size."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp: TPGroup | None = None,
        dtype: torch.dtype | None = None,
    ):
        tp = tp_or_single(tp)
        local = tp.split(out_features, f"output features ({in_features} -> {out_features} linear)")
        super().__init__(in_features, local, bias, dtype=dtype)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        rows = param.shape[0]
        full = [rows * self.tp.size, *param.shape[1:]]
        copy_checked(param.data, shard_of(loaded, full, 0, self.tp.rank * rows, rows))


class RowParallelLinear(Linear):
    """:class:`Linear` with its ``in_features`` split over the ranks: rank ``r`` holds columns
    ``[r * in / size, (r + 1) * in / size)`` of ``W``, takes that part of the input
    (``[..., in / size]``, a column-parallel layer's output) and returns the full ``[..., out]``:
    the partial products all-reduced (``reduce=True``), or this rank's partial sum (``reduce=False``,
    for a caller that adds other partial sums before one all-reduce). The bias is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp: TPGroup | None = None,
        reduce: bool = True,
        dtype: torch.dtype | None = None,
    ):
        tp = tp_or_single(tp)
        local = tp.split(in_features, f"input features ({in_features} -> {out_features} linear)")
        super().__init__(local, out_features, bias, dtype=dtype)
        self.tp, self.reduce = tp, reduce

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 1:  # the bias: whole on every rank
            copy_checked(param.data, loaded)
            return
        cols = param.shape[1]
        full = [param.shape[0], cols * self.tp.size]
        copy_checked(param.data, shard_of(loaded, full, 1, self.tp.rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        y = self.matmul(x, self.bias if self.tp.rank == 0 else None)  # [..., out] partial
        return self.tp.all_reduce(y) if self.reduce else y


FUSED = "fused"  # the shard id of a checkpoint tensor that holds every shard of a merged projection


class MergedLinear(Linear):
    """Projections of the same input concatenated on the output dim, computed in one matmul;
    column-parallel: each projection is split over the ranks and rank ``r`` holds its share of each.

    ``output_sizes[i]`` (full sizes) rows belong to shard ``shard_ids[i]`` (default ``0, 1, ...``);
    the checkpoint keeps one tensor per shard, loaded with ``weight_loader(param, tensor, shard_id)``.
    :meth:`split` cuts an output ``[..., sum(local sizes)]`` back into the shards' parts.

    ``interleaved`` (shards of one size): the shards' rows alternate, row ``j`` of shard ``i`` at row
    ``j * len(shards) + i`` of ``W`` and ``b`` (the gated MLP's ``g0, u0, g1, u1, ...``: the output
    features of one program of a one-row launch are one run of weight rows).
    """

    interleaved = False

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        shard_ids: Sequence[object] | None = None,
        tp: TPGroup | None = None,
        dtype: torch.dtype | None = None,
        interleaved: bool = False,
    ):
        tp = tp_or_single(tp)
        what = "each merged projection's output features"
        local = [tp.split(size, f"{what} {list(output_sizes)}") for size in output_sizes]
        sources = [tp.rank * n for n in local]
        if interleaved and len(set(output_sizes)) != 1:
            raise ValueError(f"expected interleaved shards of one size, got {list(output_sizes)}")
        self._init_shards(in_features, local, sources, output_sizes, bias, shard_ids, tp, dtype)
        self.interleaved = interleaved

    def _init_shards(self, in_features, local_sizes, sources, full_sizes, bias, shard_ids, tp, dtype) -> None:
        """Shard ``i``: ``local_sizes[i]`` rows here, read from row ``sources[i]`` of its checkpoint
        tensor of ``full_sizes[i]`` rows."""
        shard_ids = list(range(len(local_sizes))) if shard_ids is None else list(shard_ids)
        if len(shard_ids) != len(local_sizes):
            raise ValueError(f"expected one shard id per output size {list(local_sizes)}, got {shard_ids}")
        Linear.__init__(self, in_features, sum(local_sizes), bias, dtype=dtype)
        self.tp = tp
        self.output_sizes = list(local_sizes)
        offsets = [0]
        for size in local_sizes:
            offsets.append(offsets[-1] + size)
        self.rows = {sid: (offsets[i], offsets[i + 1], sources[i], full_sizes[i]) for i, sid in enumerate(shard_ids)}
        for param in (self.weight, self.bias):
            if param is not None:
                param.shards = tuple(shard_ids)

    def fuse_checkpoint_shards(self) -> None:
        """The checkpoint stores every shard in one tensor, concatenated in order on the output dim (Phi-3's
        ``qkv_proj`` and ``gate_up_proj``): it loads as shard :data:`FUSED`."""
        for param in (self.weight, self.bias):
            if param is not None:
                param.shards = (FUSED,)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        if shard_id == FUSED and FUSED not in self.rows:  # each shard's rows, narrowed before any read
            fulls = [full for _, _, _, full in self.rows.values()]
            start = 0
            for sid, full in zip(self.rows, fulls):
                self.weight_loader(param, shard_of(loaded, [sum(fulls), *param.shape[1:]], 0, start, full), sid)
                start += full
            return
        if shard_id not in self.rows:
            raise ValueError(f"expected a shard in {list(self.rows)}, got {shard_id!r}")
        start, end, source, full = self.rows[shard_id]
        if self.interleaved:
            rows = param.data.unflatten(0, (-1, len(self.rows)))[:, list(self.rows).index(shard_id)]
        else:
            rows = param.data[start:end]
        copy_checked(rows, shard_of(loaded, [full, *param.shape[1:]], 0, source, end - start))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y [..., sum(output_sizes)]`` -> one view per shard, in order."""
        if self.interleaved:
            return y.unflatten(-1, (-1, len(self.output_sizes))).unbind(-1)
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """The query, key and value projections of one attention layer (shards ``"q"``, ``"k"``, ``"v"``).

    Column-parallel by heads: rank ``r`` holds its ``num_heads / size`` query heads and their KV
    heads (:func:`~portattn.distributed.group.attention_heads`: split when there are at least as many
    KV heads as ranks, else the one KV head its query heads use, replicated). ``num_heads`` and
    ``num_kv_heads`` are the model's totals; :attr:`num_heads` / :attr:`num_kv_heads` this rank's.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        *,
        tp: TPGroup | None = None,
        dtype=None,
    ):
        tp = tp_or_single(tp)
        heads, kv_heads, first_kv = attention_heads(num_heads, num_kv_heads, tp)
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        sources = [tp.rank * heads * head_dim, first_kv * head_dim, first_kv * head_dim]
        full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self._init_shards(hidden_size, sizes, sources, full, bias, ("q", "k", "v"), tp, dtype)
        self.num_heads, self.num_kv_heads = heads, kv_heads


# The MLP's down projection of forwards of at most fused_linear_rows() tokens through the fused linear
# kernel (one step over up to SMALL_LINEAR_K features, the weights loaded before the launch waits for
# the gate/up kernel). On an H200 SmolLM2-135M's batch-1 decode graph took 660 us against 710 with
# cuBLAS (over 162 keys 707 against 746; benchmarks/results/engine_h200/round9/NOTES.md);
# ``python -m benchmarks.real_model --kernel-options cublas_down`` turns it off for a run.
SMALL_DOWN_PROJ = True
SMALL_LINEAR_K = 2048
# Warps of that launch: 4 up to SMALL_LINEAR_FEW_ROWS rows, else 8. At SmolLM2's 576 x 1536 on an H200
# (``scripts/kernels_probe.py small-linears``, benchmarks/results/round12_h200): 3.6 us against 4.2 with
# 8 warps at one row, 4.1 against 4.5 at 8.
SMALL_LINEAR_FEW_ROWS = 8


# One-row forwards (a batch-1 decode step) of projections over at least fused_launch.ROW_LINEAR_K
# (2048) features run
# through fused_launch.row_linear (many small programs on the vector units) instead of the vendor's
# matmul, with the norm before them and the gated activation after them folded in. On an H200, each
# launch timed alone as graph replays over weights rotated past the L2
# (benchmarks/results/engine_h200/round15/NOTES.md), at Llama-3-8B's shapes: q/k/v with its norm
# 14.9 us against 18.6 (add_rmsnorm, then cuBLAS), o 9.1 against 12.7, gate/up with its norm and SiLU
# 59.8 against 64.1 (three launches), down 27.8 against 30.7; at Qwen2.5-7B's, Llama-3.2-3B's and
# -1B's (3584, 3072 and 2048 features) every projection but the 7B's q/k/v (12.8 against 12.4) ran
# faster, at 1536 features the gate/up did not (20.9 against 19.3). Narrower rows keep the launches
# above or the vendor's matmul. With the Triton backend the q/k/v projection also rotates and writes
# the cache (row_linear_rotary, AttentionBackend.forward_projected).


# quantization="fp8"'s weights in steps of up to 16 rows: one-row steps over at least ROW_LINEAR_K features in
# row_linear, as 16-bit weights (True), or every such step in norm_linear's tensor-core tiles (False; the benchmarks'
# --kernel-options fp8_dot_rows). On sm90 row_linear spends about 8 instructions on each fp8 weight (unpacking the
# bytes, e4m3 -> f16 -> f32, the FMA) against about 2 a bfloat16 byte (Triton 3.9's PTX, round 30): at the
# H200's bandwidth that is more than its SMs issue, and its batch-1 step over fp8 weights was no faster than over
# bfloat16 ones (5.05 against 4.32 ms); the tiles convert two weights an instruction and multiply in the MMA.
FP8_ROW_LINEAR = True


def _weight_fits(linear: Linear, x: torch.Tensor) -> bool:
    """Whether the fused launches take ``linear``'s weight for rows ``x``: of the rows' dtype, or fp8 with its
    per-row scales (``quantization="fp8"``: the fp8 weight read, the rows not quantized)."""
    return linear.weight.dtype == x.dtype or linear.weight_scale is not None


def _row_ops(linear: Linear, x: torch.Tensor):
    """The fused launchers when ``linear(x)`` takes :func:`~..fused_launch.row_linear`: one row of at
    least ``ROW_LINEAR_K`` features on a GPU, a plain (or column-parallel) or single-rank row-parallel
    linear of the row's dtype (or in fp8); else ``None``."""
    if x.dim() != 2 or x.shape[0] != 1:
        return None
    ops = fused_linear_ops(x)
    weight = linear.weight
    if (
        ops is None
        or x.shape[1] < ops.ROW_LINEAR_K
        or type(linear).forward not in (Linear.forward, RowParallelLinear.forward)
        or (type(linear).forward is RowParallelLinear.forward and linear.tp.size != 1)
        or not _weight_fits(linear, x)
        or (linear.weight_scale is not None and not FP8_ROW_LINEAR)
        or x.stride(-1) != 1
        or weight.stride(-1) != 1
    ):
        return None
    return ops


def _fp8_tile_ops(linear: Linear, x: torch.Tensor):
    """The fused launchers when ``linear(x)``, fp8 weights, runs in :func:`~..fused_launch.norm_linear`'s tiles
    at any width (``FP8_ROW_LINEAR`` off; up to :func:`~.fused.fused_linear_rows` rows), else ``None``."""
    ops = fused_linear_ops(x)
    if (
        FP8_ROW_LINEAR
        or ops is None
        or linear.weight_scale is None
        or type(linear).forward not in (Linear.forward, RowParallelLinear.forward)
        or (getattr(linear, "tp", None) is not None and linear.tp.size != 1)
        or x.stride(-1) != 1
    ):
        return None
    return ops


def project(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``, through :func:`~..fused_launch.row_linear` where it takes it (see ``ROW_LINEAR_K``)."""
    ops = _row_ops(linear, x)
    if ops is not None:
        return ops.row_linear(x, linear.weight, linear.bias, weight_scale=linear.weight_scale)[0]
    if (ops := _fp8_tile_ops(linear, x)) is not None:
        return ops.norm_linear(x, linear.weight, linear.bias, weight_scale=linear.weight_scale)[0]
    return linear(x)


def project_gated(linear: Linear, x: torch.Tensor, act) -> torch.Tensor:
    """``gated(act, linear(x))`` of a gate/up projection (rows alternating where ``linear.interleaved``),
    in one :func:`~..fused_launch.row_linear` launch with the activation where it takes it (see
    ``ROW_LINEAR_K``; an MLP called without its norm: a mixture's shared expert)."""
    interleaved = getattr(linear, "interleaved", False)
    ops = _row_ops(linear, x)
    launch = None if ops is None else ops.row_linear
    if launch is None and (ops := _fp8_tile_ops(linear, x)) is not None:
        launch = ops.norm_linear
    if launch is not None and isinstance(act, Activation) and act.name in ops.ACTIVATION_CODES:
        options = dict(act=act.name, interleaved=interleaved, weight_scale=linear.weight_scale)
        return launch(x, linear.weight, linear.bias, **options)[0]
    return gated(act, linear(x), interleaved)


def small_linear(linear: Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``linear(x)`` in one launch of the fused linear kernel (no norm) where it takes it: a plain or
    single-rank row-parallel linear of the rows' dtype over at most ``SMALL_LINEAR_K`` features, rows
    as :func:`~.fused.fused_linear_ops` allows, or one row of at least ``ROW_LINEAR_K`` features
    (:func:`project`); else ``None`` (the caller runs ``linear(x)``)."""
    ops = _row_ops(linear, x)
    if ops is not None:
        return ops.row_linear(x, linear.weight, linear.bias, weight_scale=linear.weight_scale)[0]
    if (ops := _fp8_tile_ops(linear, x)) is not None:
        return ops.norm_linear(x, linear.weight, linear.bias, weight_scale=linear.weight_scale)[0]
    ops = fused_linear_ops(x)
    weight = linear.weight
    if (
        ops is None
        or type(linear).forward not in (Linear.forward, RowParallelLinear.forward)
        or (getattr(linear, "tp", None) is not None and linear.tp.size != 1)
        or x.shape[1] > SMALL_LINEAR_K
        or not _weight_fits(linear, x)
        or x.stride(-1) != 1
        or weight.stride(-1) != 1
    ):
        return None
    warps = 4 if x.shape[0] <= SMALL_LINEAR_FEW_ROWS else 8
    tiles = ops.LinearTiles(16, max(16, ops.next_pow2(x.shape[1])), warps, 1)
    return ops.norm_linear(x, weight, linear.bias, tiles=tiles, weight_scale=linear.weight_scale)[0]


def _norm_fits(linear: Linear, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None) -> bool:
    """Whether the fused launches can take ``norm``'s RMSNorm of ``x + residual`` before ``linear``."""
    return (
        type(linear).forward is Linear.forward
        and _weight_fits(linear, x)
        and norm.weight.dtype in (x.dtype, torch.float32)
        and x.stride(-1) == linear.weight.stride(-1) == 1
        and (residual is None or residual.stride(-1) == 1)
        and (norm.mode != "dtype" or norm.weight.dtype == x.dtype)
    )


def row_norm_folds(linear: Linear, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None):
    """The fused launchers when ``linear(norm(x + residual))`` of one wide row runs as one
    :func:`~..fused_launch.row_linear` launch (see ``ROW_LINEAR_K``), else ``None``."""
    ops = _row_ops(linear, x)
    return ops if ops is not None and _norm_fits(linear, x, norm, residual) else None


def norm_folds(linear: Linear, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None):
    """The fused launchers when ``linear(norm(x + residual))`` runs as one kernel (see
    :func:`norm_then_linear`), else ``None``."""
    ops = fused_linear_ops(x)
    wide = _fp8_tile_ops(linear, x) is not None  # fp8 weights in the tiles at any width (FP8_ROW_LINEAR off)
    if ops is not None and (wide or x.shape[1] <= ops.NORM_LINEAR_SINGLE_K) and _norm_fits(linear, x, norm, residual):
        return ops
    return None


def norm_then_linear(
    linear: Linear, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, act: Activation | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)`` (``residual`` None: ``x`` is the stream), with
    ``act``: ``gated(act, linear(...))``. One kernel at small batches on GPUs
    (:func:`~.fused.fused_linear_ops`) for an RMSNorm and a plain linear of the rows' dtype over at most
    ``NORM_LINEAR_SINGLE_K`` features (small models: wider rows of a few tokens stream their weights
    faster through the vendor's matmul), or of one row of at least ``ROW_LINEAR_K`` features
    (:func:`project`); the norm, the matmul and the activation one after the other elsewhere. The
    gate and up rows of a :class:`MergedLinear` with ``interleaved`` alternate."""
    interleaved = act is not None and getattr(linear, "interleaved", False)
    ops = norm_folds(linear, x, norm, residual)
    launch = ops.norm_linear if ops is not None else None
    if launch is None and (ops := row_norm_folds(linear, x, norm, residual)) is not None:
        launch = ops.row_linear
    if launch is not None:
        y, summed = launch(
            x, linear.weight, linear.bias, norm_weight=norm.weight, eps=norm.eps, residual=residual,
            mode=norm.mode, act=None if act is None else act.name, interleaved=interleaved,
            weight_scale=linear.weight_scale,
        )  # fmt: skip
        return y, (x if residual is None else summed)
    h, summed = (norm(x), x) if residual is None else norm(x, residual)
    y = linear(h)
    return (y if act is None else gated(act, y, interleaved)), summed


def _quantizable(linear: nn.Module) -> bool:
    return (
        isinstance(linear, Linear)
        and type(linear).forward in (Linear.forward, RowParallelLinear.forward)
        and linear.weight.dim() == 2
        and linear.weight.shape[0] % 16 == 0
        and linear.weight.shape[1] % 16 == 0
        and linear.weight.dtype in FP8_OUT_DTYPES
    )


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, linear)`` of every linear :func:`quantize_linears` quantizes: plain, column- or row-parallel
    and merged linears of a 16- or 32-bit float dtype whose features are multiples of 16, outside modules
    marked ``quantizable = False`` (:mod:`.fp8_linear` says which)."""
    found = []

    def walk(prefix: str, module: nn.Module) -> None:
        if not getattr(module, "quantizable", True):
            return
        if _quantizable(module):
            found.append((prefix, module))
            return
        for name, child in module.named_children():
            walk(f"{prefix}.{name}" if prefix else name, child)

    walk("", model)
    return found


def quantize_linears(model: nn.Module, quantization: str) -> int:
    """Quantize ``model``'s linears (:func:`quantizable_linears`) in place for ``quantization``
    (:mod:`.fp8_linear`): each keeps ``weight`` (now float8) and its ``weight_scale`` buffer holds the
    per-feature scales ``[1, N]``. Returns how many were quantized. The loader has checked ``quantization``
    against the model's dtype and device (:func:`portattn.quantization.check_quantization`)."""
    linears = quantizable_linears(model)
    for _, linear in linears:
        q, scale = quantize_rows(linear.weight.data)
        linear.weight = nn.Parameter(q, requires_grad=False)
        linear.weight_scale = scale.t().contiguous()  # [1, N]
    if not linears:
        raise ValueError(f"expected linear layers to quantize to {quantization}, got none in {type(model).__name__}")
    return len(linears)
