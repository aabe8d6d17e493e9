"""DeepSeek-style Multi-head Latent Attention (MLA) decode: split choice, workspace, latent cache, op.

The latent cache keeps one row per token, ``[c_kv | k_pe]`` (``kv_lora_rank + rope_dim`` wide),
shared by all query heads. Absorbed decode attends each head's ``[q_nope | q_rope]`` to those rows
(score = scale·(q_nope·c_kv + q_rope·k_pe)) and returns a weighted sum of ``c_kv``.

Split-KV: each sequence's keys are cut into ``num_kv_splits`` contiguous ranges attended in
parallel; every range leaves a partial output and its log-sum-exp in a workspace, and a merge step
combines them. The split count, and so the workspace size, is a pure function of the problem
(:func:`choose_num_kv_splits`), used both by :func:`mla_workspace_size` and by the op. No device
property enters it: a workspace sized on one machine fits the same call on any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backends.base import Capabilities, Request
from .backends.registry import select_backend
from .errors import expect
from .paging import num_pages_for
from .validation import FLOAT_DTYPES, check_int, check_tensor

# Programs (head group x split x sequence) that keep any current GPU busy with a few in flight
# per compute unit (132 SMs on an H200, 64 Xe cores on a Max 1550, 304 CUs on an MI300X).
TARGET_PROGRAMS = 256
HEADS_PER_PROGRAM = 64  # query heads one program covers at most (for counting programs only)
MAX_KV_SPLITS = 64
# A split must be long enough that its partial output (4·kv_lora_rank bytes per head, written and
# read back) stays small beside the latent rows it reads (~2·(kv_lora_rank + rope_dim) per token).
MIN_SPLIT_TOKENS = 256
MIN_SPLIT_TOKENS_PER_HEAD = 32


class MLARequest(Request):
    """A request for the ``mla_decode`` op. MLA kernels take any latent width (``kv_lora_rank +
    rope_dim``), so a backend's head-dim list (which describes its attention kernels) is not
    matched; the op, device, dtype and features are."""

    def missing(self, caps: Capabilities) -> tuple[str, object] | None:
        needs = [("op", self.op), ("device", self.device_type), ("dtype", self.dtype)]
        needs += [("feature", feature) for feature in sorted(self.features)]
        return next(((kind, value) for kind, value in needs if not caps.supports(kind, value)), None)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_num_kv_splits(max_seq_len: int, batch_size: int, num_heads: int) -> int:
    """Split count for a decode batch, from the problem alone.

    Without splits a batch offers ``batch_size · ceil(num_heads / 64)`` programs; splits are added
    until there are about ``TARGET_PROGRAMS`` of them, but never so many that a split of the
    longest sequence gets fewer than ``max(256, 32 · num_heads)`` tokens, and never more than
    ``MAX_KV_SPLITS``. Always at least 1.
    """
    programs = max(1, batch_size) * _cdiv(max(1, num_heads), HEADS_PER_PROGRAM)
    wanted = _cdiv(TARGET_PROGRAMS, programs)
    min_tokens = max(MIN_SPLIT_TOKENS, MIN_SPLIT_TOKENS_PER_HEAD * num_heads)
    return max(1, min(wanted, max_seq_len // min_tokens, MAX_KV_SPLITS))


def resolve_num_kv_splits(num_kv_splits: int | None, max_seq_len: int, batch_size: int, num_heads: int) -> int:
    """``None`` or ``-1``: :func:`choose_num_kv_splits`; otherwise the given count (>= 1)."""
    if num_kv_splits is None or num_kv_splits == -1:
        return choose_num_kv_splits(max_seq_len, batch_size, num_heads)
    check_int("num_kv_splits", num_kv_splits, 1)
    return num_kv_splits


def mla_workspace_size(
    max_seq_len: int,
    batch_size: int,
    num_heads: int,
    page_size: int,
    *,
    num_kv_splits: int = -1,
    kv_lora_rank: int = 512,
) -> int:
    """Bytes of workspace that :func:`mla_decode` needs for a batch of this shape.

    A pure function of its arguments: ``S = num_kv_splits`` (or, for ``-1``,
    ``choose_num_kv_splits(max_seq_len, batch_size, num_heads)``, the split count ``mla_decode``
    then uses), and the size is ``4 · batch_size · num_heads · S · (kv_lora_rank + 1)`` -- one
    float32 partial output and one float32 log-sum-exp per (sequence, head, split) -- or 0 when
    ``S == 1`` (the kernel then writes the output directly).

    ``max_seq_len`` is the longest sequence of the calls the workspace serves (any upper bound
    works: the size never shrinks as it grows). ``page_size`` is checked but does not change the
    size: splits are cut in tokens, so every page size needs the same workspace.

    Allocate it as ``torch.empty(size, dtype=torch.uint8, device=...)``; its contents need no
    initialisation and are scratch after the call.
    """
    check_int("max_seq_len", max_seq_len, 0)
    check_int("batch_size", batch_size, 0)
    check_int("num_heads", num_heads, 1)
    check_int("page_size", page_size, 1)
    check_int("kv_lora_rank", kv_lora_rank, 1)
    splits = resolve_num_kv_splits(num_kv_splits, max_seq_len, batch_size, num_heads)
    if splits == 1:
        return 0
    return 4 * batch_size * num_heads * splits * (kv_lora_rank + 1)


def partial_buffers(
    workspace: torch.Tensor, batch_size: int, num_heads: int, num_kv_splits: int, kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the workspace: partial outputs ``[B, H, S, R]`` and log-sum-exps ``[B, H, S]``, float32."""
    rows = batch_size * num_heads * num_kv_splits
    floats = workspace[: 4 * rows * (kv_lora_rank + 1)].view(torch.float32)
    part_out = floats[: rows * kv_lora_rank].view(batch_size, num_heads, num_kv_splits, kv_lora_rank)
    part_lse = floats[rows * kv_lora_rank :].view(batch_size, num_heads, num_kv_splits)
    return part_out, part_lse


def split_latent(kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(c_kv [N, P, R], k_pe [N, P, rope_dim])`` of a latent cache ``[N, P, R + rope_dim]``."""
    return kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:]


def write_latent(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new tokens' rows: ``kv_cache`` slot ``slots[t]`` (= page·P + offset) gets ``[c_kv[t] | k_pe[t]]``.

    ``c_kv [T, R]``, ``k_pe [T, rope_dim]``, ``slots [T]`` integer; ``kv_cache`` must be contiguous.
    """
    rank = c_kv.shape[-1]
    rows = kv_cache.view(-1, kv_cache.shape[-1])  # [N * P, R + rope_dim]
    rows[slots, :rank] = c_kv.to(kv_cache.dtype)
    rows[slots, rank:] = k_pe.to(kv_cache.dtype)


@dataclass(frozen=True, eq=False)
class MLADecodeMetadata:
    """Per-forward facts of MLA decode, built once by :func:`plan_mla_decode` and shared by all layers."""

    page_table: torch.Tensor  # [B, max_pages] int32, page-granular
    seq_lens: torch.Tensor  # [B] int32
    page_size: int
    max_seq_len: int  # an upper bound of seq_lens (host int)
    num_kv_splits: int
    workspace: torch.Tensor | None  # uint8, at least workspace_bytes; None when num_kv_splits == 1
    workspace_bytes: int
    partials: tuple[torch.Tensor, torch.Tensor] | None = None  # partial_buffers views of the workspace

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


def plan_mla_decode(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    num_heads: int,
    kv_lora_rank: int,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    workspace: torch.Tensor | None = None,
) -> MLADecodeMetadata:
    """Once per forward: choose the split count and provide the workspace.

    ``max_seq_len`` is a host int bounding ``seq_lens`` (an engine knows it); when omitted it is
    the page table's capacity ``max_pages · page_size``, so planning never syncs with the device.
    A given ``workspace`` must hold ``mla_workspace_size(max_seq_len, B, num_heads, page_size,
    num_kv_splits=..., kv_lora_rank=...)`` bytes; otherwise one is allocated. Its partial-result
    views are cut here, once, so that the per-layer launches only pass them on.
    """
    batch = seq_lens.shape[0]
    if max_seq_len is None:
        max_seq_len = page_table.shape[1] * page_size
    splits = resolve_num_kv_splits(num_kv_splits, max_seq_len, batch, num_heads)
    needed = mla_workspace_size(
        max_seq_len, batch, num_heads, page_size, num_kv_splits=splits, kv_lora_rank=kv_lora_rank
    )
    if workspace is not None:
        check_tensor("workspace", workspace, 1, (torch.uint8,), seq_lens.device)
        expect(workspace.is_contiguous(), "a contiguous workspace", f"strides {workspace.stride()}")
        expect(workspace.data_ptr() % 16 == 0, "workspace aligned to 16 bytes", f"address {workspace.data_ptr()}")
        expect(
            workspace.numel() >= needed,
            f"a workspace of at least {needed} bytes (mla_workspace_size for {splits} splits)",
            f"{workspace.numel()} bytes",
        )
    elif needed:
        workspace = torch.empty(needed, dtype=torch.uint8, device=seq_lens.device)
    workspace = workspace if needed else None
    return MLADecodeMetadata(
        page_table=page_table,
        seq_lens=seq_lens,
        page_size=page_size,
        max_seq_len=max_seq_len,
        num_kv_splits=splits,
        workspace=workspace,
        workspace_bytes=needed,
        partials=None if workspace is None else partial_buffers(workspace, batch, num_heads, splits, kv_lora_rank),
    )


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_kv_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """MLA decode: one query per sequence over its paged latent cache (absorbed form).

    Shapes (``B`` sequences, ``H`` query heads, ``R = kv_lora_rank``, ``Dr = rope_dim``,
    ``P`` = page size)::

        q_nope      [B, H, R]
        q_rope      [B, H, Dr]
        kv_cache    [num_pages, P, R + Dr]     row = [c_kv | k_pe], one latent head
        page_table  [B, max_pages] int32       page-granular: column p = physical page of
                                               logical page p (see portattn.to_page_table)
        seq_lens    [B] int32                  keys of sequence b (the current token included)
        -> out      [B, H, R]                  dtype of q_nope

    For each sequence ``b`` and head ``h``, over its keys ``j < seq_lens[b]``::

        s_j = scale · (q_nope[b, h] · c_kv_j + q_rope[b, h] · k_pe_j)
        out[b, h] = Σ_j softmax(s)_j · c_kv_j

    Key ``j`` lives in slot ``page_table[b, j // P] · P + j % P``. Example with ``P = 2``: a
    sequence of 3 keys in physical pages 5 and 0 has the row ``[5, 0, <anything>...]``. Slots past
    ``seq_lens[b]`` and page-table columns past its last page are never read. A sequence with
    ``seq_lens[b] == 0`` returns zeros. Any page size, rank, rope dim and head count.

    ``num_kv_splits``: ``None`` (or -1) chooses from the problem with
    :func:`choose_num_kv_splits` (``max_seq_len`` = the longest sequence); a positive int forces
    that many. Results agree across split counts within rounding. ``workspace``: optional uint8
    tensor of at least ``mla_workspace_size(max(seq_lens), B, H, P, num_kv_splits=...,
    kv_lora_rank=R)`` bytes (allocated per call when omitted; pass one to reuse it, e.g. under a
    captured graph). Backends that need no workspace (``torch``) ignore it.

    Raises:
        ValueError: inputs of the wrong shape, dtype, device or value ("expected ..., got ...");
            ``UnsupportedFeatureError`` if ``backend`` lacks MLA decode.
    """
    check_tensor("q_nope", q_nope, 3, FLOAT_DTYPES, q_nope.device if isinstance(q_nope, torch.Tensor) else None)
    device, dtype = q_nope.device, q_nope.dtype
    batch, num_heads, rank = q_nope.shape
    expect(num_heads >= 1 and rank >= 1, "q_nope of shape [B, H >= 1, kv_lora_rank >= 1]", list(q_nope.shape))
    check_tensor("q_rope", q_rope, 3, (dtype,), device)
    rope_dim = q_rope.shape[2]
    expect(
        tuple(q_rope.shape[:2]) == (batch, num_heads),
        f"q_rope of shape [{batch}, {num_heads}, rope_dim] (as q_nope)",
        list(q_rope.shape),
    )
    check_tensor("kv_cache", kv_cache, 3, (dtype,), device)
    num_pages, page_size, row = kv_cache.shape
    expect(
        row == rank + rope_dim,
        f"kv_cache rows of kv_lora_rank + rope_dim = {rank} + {rope_dim} = {rank + rope_dim}",
        row,
    )
    check_tensor("page_table", page_table, 2, (torch.int32,), device)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), device)
    expect(seq_lens.shape[0] == batch, f"seq_lens of shape [{batch}] (one per sequence)", list(seq_lens.shape))
    expect(page_table.shape[0] == batch, f"page_table with {batch} rows (one per sequence)", list(page_table.shape))
    expect(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0, "a positive finite scale", scale)
    lens = seq_lens.tolist()
    bad = next((b for b, n in enumerate(lens) if n < 0), None)
    expect(bad is None, "seq_lens >= 0", f"seq_lens[{bad}] = {lens[bad]}" if bad is not None else "")
    max_seq_len = max(lens, default=0)
    expect(
        page_table.shape[1] * page_size >= max_seq_len,
        f"page_table with at least {num_pages_for(max_seq_len, page_size)} columns for {max_seq_len} keys "
        f"at page size {page_size}",
        page_table.shape[1],
    )
    if batch and max_seq_len:
        cols = torch.arange(page_table.shape[1], device=device)
        used = cols[None, :] * page_size < seq_lens[:, None]  # [B, max_pages]
        out_of_range = used & ((page_table < 0) | (page_table >= num_pages))
        if bool(out_of_range.any()):
            b, col = (int(i) for i in out_of_range.nonzero()[0])
            raise ValueError(
                f"expected page ids in [0, {num_pages}) for used pages, got {int(page_table[b, col])} "
                f"at page_table[{b}, {col}]"
            )
    request = MLARequest("mla_decode", device.type, dtype, rank + rope_dim)
    impl = select_backend("attention", backend, request)
    metadata = plan_mla_decode(
        page_table,
        seq_lens,
        page_size,
        num_heads=num_heads,
        kv_lora_rank=rank,
        max_seq_len=max_seq_len,
        num_kv_splits=num_kv_splits,
        workspace=workspace,
    )
    out = torch.empty((batch, num_heads, rank), dtype=dtype, device=device)
    return impl.mla_decode(q_nope, q_rope, kv_cache, metadata, float(scale), out)
