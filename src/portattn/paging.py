"""Pages, page tables and the page allocator.

Two table granularities exist in a paged KV cache, and mixing them up is silent: the numbers are
all valid slot or page ids, and attention simply reads the wrong keys.

* ``req_to_token`` rows are **token-granular**: column ``i`` holds the slot of the request's
  token ``i`` (``slot = page_id * page_size + offset``).
* a ``page_table`` is **page-granular**: column ``p`` holds the physical page of logical page ``p``.

Example with ``page_size = 4``, one request of 6 tokens living in physical pages 7 and 2::

    req_to_token row : [28, 29, 30, 31,  8,  9]      (slots)
    page_table row   : [ 7,  2]                      (pages)

:func:`to_page_table` is the only place that converts the first into the second. Every function
that takes a table says which granularity it expects.
"""

from __future__ import annotations

import torch

from .errors import OutOfPagesError


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // page_size)


def to_page_table(
    token_table: torch.Tensor,
    page_size: int,
    *,
    seq_lens: torch.Tensor | None = None,
    check: bool = False,
) -> torch.Tensor:
    """Convert token-granular rows (``req_to_token``) into a page-granular page table.

    Args:
        token_table: ``[B, max_context]`` integer slots; column ``i`` is the slot of token ``i``.
            Allocation must be page-aligned: the tokens of logical page ``p`` occupy one
            physical page, in order (slots ``page * page_size + 0 .. page_size - 1``).
        page_size: tokens per page ``P`` (any positive integer, including 1 and odd sizes).
        seq_lens: ``[B]`` number of valid tokens per row; only used by ``check``. Columns at or
            past a row's length may hold anything.
        check: verify page alignment of every valid token and raise a ``ValueError`` naming the
            first offending row and column. Costs one pass over the table and one host sync.

    Returns:
        ``[B, ceil(max_context / P)]`` int32 page table: ``page_table[b, p] =
        token_table[b, p * P] // P``. Entries of pages past ``seq_lens`` are meaningless.
    """
    if token_table.dim() != 2:
        raise ValueError(f"expected token_table of shape [B, max_context], got {tuple(token_table.shape)}")
    if token_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expected token_table of dtype int32 or int64, got {token_table.dtype}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"expected page_size to be a positive int, got {page_size!r}")
    page_table = torch.div(token_table[:, ::page_size], page_size, rounding_mode="floor").to(torch.int32)
    if check:
        _check_page_aligned(token_table, page_table, page_size, seq_lens)
    return page_table


def _check_page_aligned(
    token_table: torch.Tensor, page_table: torch.Tensor, page_size: int, seq_lens: torch.Tensor | None
) -> None:
    batch, width = token_table.shape
    cols = torch.arange(width, device=token_table.device)
    expected = page_table.long()[:, cols // page_size] * page_size + cols % page_size  # [B, W]
    bad = expected != token_table.long()
    if seq_lens is not None:
        if seq_lens.shape != (batch,):
            raise ValueError(f"expected seq_lens of shape [{batch}], got {tuple(seq_lens.shape)}")
        if batch and int(seq_lens.max()) > width:
            raise ValueError(f"seq_lens exceed the table width {width}: max is {int(seq_lens.max())}")
        bad &= cols[None, :] < seq_lens.to(cols.device)[:, None]
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"token_table is not page-aligned at row {row}, column {col}: expected slot "
            f"{int(expected[row, col])} (page {int(page_table[row, col // page_size])}, offset "
            f"{col % page_size}), got {int(token_table[row, col])}"
        )


class PageAllocator:
    """A free list of physical pages with reference counts.

    ``allocate`` hands out pages with a count of one; ``retain`` adds a holder (prefix sharing);
    ``free`` drops one holder and returns the page to the pool when none is left. Freeing a page
    that nobody holds raises, so double frees are caught where they happen.
    """

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"expected num_pages to be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pops low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"expected a non-negative page count, got {n}")
        if n > len(self._free):
            raise OutOfPagesError(f"cannot allocate {n} pages: {len(self._free)} of {self.num_pages} are free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for page in pages:
            self._check_held(page, "retain")
        for page in pages:
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        counts: dict[int, int] = {}
        for page in pages:
            counts[page] = counts.get(page, 0) + 1
        for page, n in counts.items():
            self._check_held(page, "free")
            if self._refs[page] < n:
                raise ValueError(f"double free of page {page}: it has {self._refs[page]} holder(s), freed {n}")
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def ref_count(self, page: int) -> int:
        self._check_id(page)
        return self._refs[page]

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"expected a page id in [0, {self.num_pages}), got {page}")

    def _check_held(self, page: int, action: str) -> None:
        self._check_id(page)
        if self._refs[page] == 0:
            verb = "double free of" if action == "free" else "cannot retain free"
            raise ValueError(f"{verb} page {page}: it is not allocated")
