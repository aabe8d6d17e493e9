"""Checks of public inputs, shared by the ops, the MLA op and the vision encoder.

Every check raises ``ValueError("expected ..., got ...")`` through :func:`portattn.errors.expect`,
naming the argument, what was expected and what came.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from .backends.base import AttentionParams
from .errors import expect, fail, is_int, is_real
from .paging import PageTable, num_pages_for

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when the current index is 0."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.accelerator.current_device_index() if a.type != "cpu" else None
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def check_tensor(name: str, t: object, dim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    expect(isinstance(t, torch.Tensor), f"{name} to be a torch.Tensor", type(t).__name__)
    expect(t.dim() == dim, f"{name} with {dim} dims", f"shape {tuple(t.shape)}")
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    expect(t.dtype in dtypes, f"{name} of dtype {names}", t.dtype)
    expect(same_device(t.device, device), f"{name} on {device}", t.device)


def debug_checks() -> bool:
    """``PORTATTN_DEBUG=1`` (any value but empty or 0): the ops check raw page tables fully."""
    return os.environ.get("PORTATTN_DEBUG", "0") not in ("", "0")


def check_sizes(sizes: dict[str, int]) -> None:
    """Sizes that later code divides by (head dims, page size), by description: each at least 1."""
    for name, value in sizes.items():
        expect(value >= 1, f"{name} >= 1", value)


def check_page_table(
    page_table: torch.Tensor,
    lens: list[int],
    seq_lens: torch.Tensor,
    page_size: int,
    num_pages: int,
    *,
    check: bool | None,
) -> None:
    """``page_table [B, W]`` (page-granular) for sequences of ``lens`` keys over ``num_pages`` pages of ``page_size``.

    Always: a :class:`~portattn.paging.PageTable` made for another page size is refused, the
    table is wide enough for the longest sequence, and the columns that hold keys (the first
    ``ceil(lens[b] / P)`` of row ``b``) are page ids in ``[0, num_pages)``. With ``check``
    (``None``: :func:`debug_checks`), also: no page twice in one row; a page in two rows only as
    part of a common prefix (the same page in the same column, the columns before it equal, as a
    prefix cache shares them); and a raw table (not a ``PageTable``) may not have one column per
    key of its longest sequence when fewer would do, the shape of token-granular ``req_to_token``
    rows passed by mistake.
    """
    if isinstance(page_table, PageTable):
        expect(
            page_table.page_size == page_size,
            f"a page_table for page size {page_size} (the cache's)",
            f"a PageTable made for page size {page_table.page_size}",
        )
    width, max_keys = page_table.shape[1], max(lens, default=0)
    need = num_pages_for(max_keys, page_size)
    expect(
        width >= need,
        f"page_table with at least {need} columns for {max_keys} keys at page size {page_size}",
        width,
    )
    if not lens or not max_keys:
        return
    cols = torch.arange(width, device=page_table.device)
    used = cols[None, :] * page_size < seq_lens[:, None]  # [B, W]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        fail(f"page ids in [0, {num_pages}) for used pages", f"{int(page_table[row, col])} at page_table[{row}, {col}]")
    if not (debug_checks() if check is None else check):
        return
    if not isinstance(page_table, PageTable) and page_size > 1 and width > need and width >= max_keys:
        fail(
            f"a page-granular page_table ({need} columns hold {max_keys} keys at page size {page_size})",
            f"{width} columns, one per key: token-granular req_to_token rows? Convert them with "
            "portattn.to_page_table, or pass only the columns in use",
        )
    rows = page_table[:, :need].tolist()
    seen: dict[int, tuple[int, int]] = {}  # page -> (row, column) of its first use
    for b, n in enumerate(lens):
        for c in range(num_pages_for(n, page_size)):
            page = rows[b][c]
            if page not in seen:
                seen[page] = (b, c)
                continue
            b0, c0 = seen[page]
            expect(
                b0 != b and c0 == c and rows[b0][:c] == rows[b][:c],
                "each page once per row, and shared between rows only in a common prefix",
                f"page {page} at page_table[{b0}, {c0}] and page_table[{b}, {c}]",
            )


def check_pixel_values(pixel_values: object, name: str = "pixel_values") -> None:
    """Image patches ``[N, patch_dim]``: a floating-point tensor with finite values only."""
    expect(isinstance(pixel_values, torch.Tensor), f"{name} to be a torch.Tensor", type(pixel_values).__name__)
    expect(pixel_values.is_floating_point(), f"floating-point {name}", pixel_values.dtype)
    finite = torch.isfinite(pixel_values)
    if not bool(finite.all()):
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        fail(f"finite {name}", f"{pixel_values[where].item()} at {name}{list(where)}")


def check_head_groups(num_q_heads: int, num_kv_heads: int) -> None:
    """MHA, GQA and MQA: every KV head serves the same number of query heads."""
    expect(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"query heads divisible by KV heads ({num_kv_heads})",
        num_q_heads,
    )


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> list[int]:
    """Validate offsets and return the per-sequence lengths (host copy)."""
    expect(cu.numel() >= 1, f"{name} of shape [B + 1]", f"shape {tuple(cu.shape)}")
    values = cu.tolist()
    expect(values[0] == 0, f"{name}[0] == 0", values[0])
    lens = [b - a for a, b in itertools.pairwise(values)]
    bad = next((i for i, n in enumerate(lens) if n < 0), None)
    expect(
        bad is None,
        f"non-decreasing {name}",
        f"{name}[{bad}:{bad + 2}] = {values[bad : bad + 2]}" if bad is not None else "",
    )
    expect(values[-1] == total, f"{name}[-1] == {total} (tokens in the input)", values[-1])
    return lens


def attention_params(
    *,
    head_dim: int,
    num_q_heads: int,
    scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    attention_chunk_size: int | None,
    sinks: torch.Tensor | None,
    logit_softcap: float,
    device: torch.device,
) -> AttentionParams:
    expect(is_int(window_left) and window_left >= -1, "window_left to be an int >= -1", window_left)
    expect(is_int(window_right) and window_right >= -1, "window_right to be an int >= -1", window_right)
    if attention_chunk_size is not None:
        expect(
            is_int(attention_chunk_size) and attention_chunk_size >= 1,
            "attention_chunk_size to be None or a positive int",
            attention_chunk_size,
        )
    expect(isinstance(causal, bool), "causal to be a bool", causal)
    expect(is_real(logit_softcap) and logit_softcap >= 0, "logit_softcap >= 0 (0 disables it)", logit_softcap)
    expect(math.isfinite(logit_softcap), "a finite logit_softcap", logit_softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    expect(is_real(scale) and math.isfinite(scale) and scale > 0, "a positive finite scale", scale)
    if sinks is not None:
        check_tensor("sinks", sinks, 1, FLOAT_DTYPES, device)
        expect(
            sinks.shape[0] == num_q_heads, f"sinks of shape [{num_q_heads}] (one per query head)", tuple(sinks.shape)
        )
    return AttentionParams(
        scale=float(scale),
        causal=bool(causal),
        window_left=window_left,
        window_right=window_right,
        attention_chunk_size=attention_chunk_size,
        sinks=sinks,
        logit_softcap=float(logit_softcap),
    )


def check_out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, len(shape), (like.dtype,), like.device)
    expect(tuple(out.shape) == shape, f"out of shape {list(shape)}", list(out.shape))
    return out
