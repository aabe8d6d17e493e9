"""Vision-encoder attention: per-forward sequence facts, and one mm backend chosen once.

A vision encoder attends within each image frame (full-attention blocks) or within windows of a
frame (window blocks), never across images. Which tokens form a sequence depends only on the
images' patch grids, so it is worked out once per encoder forward, into one frozen
:class:`EncoderSeqInfo` that every block receives: the ``VarlenMetadata`` of the frames and of the
windows (cu_seqlens on the device, lengths and max lengths as Python ints) and the window
permutation with its inverse. Blocks read Python ints and tensors from it and never sync with the
device; nothing is stored on a tensor.

:class:`EncoderAttention` selects the ``mm`` backend once, when the encoder is built: an explicit
name (argument, or the ``--mm-attention-backend`` flag passed as one) > ``PORTATTN_MM_ATTENTION_BACKEND``
> ``auto``. The features the encoder's attention needs (non-causal, and a window, sinks or softcap
when asked) are checked then, so a backend that lacks one fails with
:class:`~portattn.UnsupportedFeatureError` before any forward.

Grids follow Hugging Face's Qwen-VL processors: ``grid_thw [num_images, 3]`` holds each image's
frames ``t`` and patch rows/columns ``h, w``; patches are ordered frame by frame and, inside a
frame, in ``m x m`` merge blocks (``m = spatial_merge_size``), block-row-major. A *unit* is one
merge block (``m * m`` consecutive tokens), the row the patch merger turns into one embedding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .backends.base import AttentionBackend, Request
from .backends.metadata import VarlenMetadata, cu_seqlens_of
from .backends.registry import select_backend
from .errors import expect, is_int
from .validation import attention_params


def grid_list(
    grid_thw: torch.Tensor | Sequence[Sequence[int]], spatial_merge_size: int = 1
) -> list[tuple[int, int, int]]:
    """``grid_thw`` as Python ``(t, h, w)`` triples (one host copy), validated."""
    if isinstance(grid_thw, torch.Tensor):
        expect(
            grid_thw.dim() == 2 and grid_thw.shape[1] == 3, "grid_thw of shape [num_images, 3]", list(grid_thw.shape)
        )
        expect(not grid_thw.is_floating_point(), "grid_thw of an integer dtype", grid_thw.dtype)
        grid_thw = grid_thw.tolist()
    grid = [tuple(row) if isinstance(row, (list, tuple)) else (row,) for row in grid_thw]
    for i, row in enumerate(grid):
        ok = len(row) == 3 and all(is_int(x) and x >= 1 for x in row)  # 1.5 is not truncated to 1
        expect(ok, f"grid_thw[{i}] = (t, h, w) of positive ints", row)
        _, h, w = row
        expect(
            h % spatial_merge_size == 0 and w % spatial_merge_size == 0,
            f"grid_thw[{i}] h and w divisible by spatial_merge_size {spatial_merge_size}",
            row,
        )
    grid = [(int(t), int(h), int(w)) for t, h, w in grid]
    return grid


def frame_lengths(grid: Sequence[tuple[int, int, int]]) -> list[int]:
    """Tokens of each frame, in order: each frame is one full-attention sequence."""
    return [h * w for t, h, w in grid for _ in range(t)]


def grid_positions(grid: Sequence[tuple[int, int, int]], spatial_merge_size: int) -> torch.Tensor:
    """``[N, 2]`` int64 (row, column) of every patch, in the processor's merge-block order (CPU)."""
    m = spatial_merge_size
    out = []
    for t, h, w in grid:
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)  # [h/m, m, w/m, m]
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        pos = torch.stack([rows, cols], dim=-1).permute(0, 2, 1, 3, 4)  # [h/m, w/m, m, m, 2] block-major
        out.append(pos.reshape(h * w, 2).repeat(t, 1))  # [t*h*w, 2]
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.int64)


def window_partition(
    grid: Sequence[tuple[int, int, int]], spatial_merge_size: int, window_units: int
) -> tuple[torch.Tensor, list[int]]:
    """Windows of ``window_units x window_units`` merge units, tiled from each frame's top-left corner.

    Returns ``(window_index [U] int64, window_lengths)`` on the CPU: unit ``i`` of the window order
    is unit ``window_index[i]`` of the input order; windows are listed frame by frame, row-major,
    each with its units row-major; ``window_lengths`` are in tokens. Windows on the bottom and
    right edges may be smaller.
    """
    expect(window_units >= 1, "a window of at least one merge unit", window_units)
    indices, lengths, offset = [], [], 0
    for t, h, w in grid:
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        nh, nw = -(-gh // window_units), -(-gw // window_units)
        rows = torch.arange(gh).view(1, gh, 1) // window_units  # [1, gh, 1]
        cols = torch.arange(gw).view(1, 1, gw) // window_units  # [1, 1, gw]
        frames = torch.arange(t).view(t, 1, 1)
        window_id = (frames * nh + rows) * nw + cols  # [t, gh, gw]
        # A stable sort by window keeps each window's units in row-major order.
        order = torch.sort(window_id.flatten(), stable=True).indices  # [t * gh * gw]
        counts = torch.bincount(window_id.flatten(), minlength=t * nh * nw)
        indices.append(order + offset)
        lengths += [n * spatial_merge_size**2 for n in counts.tolist() if n]
        offset += t * gh * gw
    index = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64)
    return index, lengths


@dataclass(frozen=True, eq=False)
class EncoderSeqInfo:
    """One encoder forward's sequences, built once and passed to every block.

    ``full``: one sequence per frame, over the tokens in window order (windows never cross a
    frame, so frame boundaries do not move). ``window``: one sequence per window (equal to
    ``full`` when the encoder has no windows). ``window_index [U]`` / ``reverse_index [U]``
    (int64, on the device; ``None`` without windows): unit ``i`` of the window order is input unit
    ``window_index[i]``, and ``reverse_index = argsort(window_index)``. ``unit`` tokens form one
    unit; ``num_tokens = U * unit``.
    """

    full: VarlenMetadata
    window: VarlenMetadata
    window_index: torch.Tensor | None
    reverse_index: torch.Tensor | None
    unit: int
    num_tokens: int
    positions: torch.Tensor | None = None  # [N, 2] int64 (row, column) of each token, in window order

    @classmethod
    def from_grid(
        cls,
        backend: AttentionBackend,
        grid_thw: torch.Tensor | Sequence[Sequence[int]],
        *,
        spatial_merge_size: int,
        window_units: int | None = None,
        device: torch.device | str,
    ) -> EncoderSeqInfo:
        """Plan an encoder forward over ``grid_thw`` (every host sync of the forward happens here).

        ``window_units``: the window side in merge units (Qwen2.5-VL: ``window_size //
        spatial_merge_size // patch_size``); ``None`` for an encoder without window blocks.
        """
        device = torch.device(device)
        grid = grid_list(grid_thw, spatial_merge_size)
        info = cls.from_lengths(
            backend,
            frame_lengths(grid),
            window=None if window_units is None else window_partition(grid, spatial_merge_size, window_units),
            unit=spatial_merge_size**2,
            device=device,
        )
        positions = info.to_window_order(grid_positions(grid, spatial_merge_size).to(device))  # [N, 2]
        return dataclasses.replace(info, positions=positions)

    @classmethod
    def from_lengths(
        cls,
        backend: AttentionBackend,
        lengths: Sequence[int],
        *,
        window: tuple[torch.Tensor, Sequence[int]] | None = None,
        unit: int = 1,
        device: torch.device | str,
    ) -> EncoderSeqInfo:
        """From sequence lengths in tokens and, optionally, ``(window_index [U], window_lengths)``."""
        device = torch.device(device)
        lengths = [int(n) for n in lengths]
        num_tokens = sum(lengths)
        expect(num_tokens % unit == 0, f"a token count divisible by the unit {unit}", num_tokens)
        full = _plan(backend, lengths, device)
        if window is None:
            return cls(full, full, None, None, unit, num_tokens)
        window_index, window_lengths = window
        expect(
            tuple(window_index.shape) == (num_tokens // unit,),
            f"window_index of shape [{num_tokens // unit}]",
            list(window_index.shape),
        )
        expect(sum(window_lengths) == num_tokens, f"window lengths summing to {num_tokens}", sum(window_lengths))
        window_index = window_index.to(device=device, dtype=torch.int64)
        reverse_index = torch.argsort(window_index)  # [U]
        return cls(full, _plan(backend, window_lengths, device), window_index, reverse_index, unit, num_tokens)

    def metadata(self, full_attention: bool) -> VarlenMetadata:
        return self.full if full_attention else self.window

    def to_window_order(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, ...]`` in input order -> window order (a gather of whole units)."""
        if self.window_index is None:
            return x
        units = x.view(self.num_tokens // self.unit, self.unit, *x.shape[1:])  # [U, unit, ...]
        return units[self.window_index].view(x.shape)  # [N, ...]

    def from_window_order(self, x: torch.Tensor) -> torch.Tensor:
        """``x [U, ...]`` (one row per unit, e.g. merged embeddings) in window order -> input order."""
        return x if self.reverse_index is None else x[self.reverse_index]


def _plan(backend: AttentionBackend, lengths: list[int], device: torch.device) -> VarlenMetadata:
    cu = cu_seqlens_of(lengths, device)
    longest = max(lengths, default=0)
    return backend.plan_varlen(cu, cu, max_seqlen_q=longest, max_seqlen_k=longest)


class EncoderAttention:
    """Non-causal varlen attention for an encoder, through one ``mm`` backend selected at construction.

    ``backend``: a registered name, or ``"auto"`` (then ``PORTATTN_MM_ATTENTION_BACKEND``, then the
    fastest backend here that covers the request). ``window_size``, ``sinks [num_heads]`` and
    ``logit_softcap`` follow :func:`portattn.varlen_attention`. A backend that lacks a needed feature,
    head dim, dtype or device raises :class:`~portattn.UnsupportedFeatureError` here, naming the
    backends that have it.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: str = "auto",
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        sinks: torch.Tensor | None = None,
        logit_softcap: float = 0.0,
    ):
        device = torch.device(device)
        expect(is_int(num_heads) and num_heads >= 1, "num_heads to be a positive int", num_heads)
        expect(is_int(head_dim) and head_dim >= 1, "head_dim to be a positive int", head_dim)
        expect(
            isinstance(window_size, (tuple, list)) and len(window_size) == 2,
            "window_size as a (left, right) pair",
            window_size,
        )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.params = attention_params(
            head_dim=head_dim,
            num_q_heads=num_heads,
            scale=scale,
            causal=False,
            window_left=window_size[0],
            window_right=window_size[1],
            attention_chunk_size=None,
            sinks=sinks,
            logit_softcap=logit_softcap,
            device=device,
        )
        request = Request("varlen_attention", device.type, dtype, head_dim, self.params.features(head_dim, head_dim))
        self.backend = select_backend("mm", backend, request)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def plan(
        self,
        grid_thw: torch.Tensor | Sequence[Sequence[int]],
        *,
        spatial_merge_size: int,
        window_units: int | None = None,
        device: torch.device | str,
    ) -> EncoderSeqInfo:
        """:meth:`EncoderSeqInfo.from_grid` with this encoder's backend."""
        return EncoderSeqInfo.from_grid(
            self.backend, grid_thw, spatial_merge_size=spatial_merge_size, window_units=window_units, device=device
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: VarlenMetadata) -> torch.Tensor:
        """``q, k, v [N, H, D]`` -> ``[N, H, D]``, each sequence of ``metadata`` attending within itself."""
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))  # [N, H, Dv]
        return self.backend.varlen_attention(q, k, v, metadata, self.params, out)
