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
that takes a table says which granularity it expects, and its result is a :class:`PageTable`: a
tensor that carries its page size, which the ops check against the cache they read.
"""

from __future__ import annotations

import torch

from .errors import OutOfPagesError, is_int


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // page_size)


class PageTable(torch.Tensor):
    """A page-granular table ``[B, max_pages]`` int32 that knows its page size.

    :func:`to_page_table` returns one; wrap a table built page-granular by other means with
    ``PageTable(table, page_size)``. It is the table tensor itself (same storage, usable wherever a
    tensor is), and ``page_table.page_size`` says which cache layout it was made for: the ops
    refuse it against a cache of another page size. The results of tensor operations on it
    (slices, ``.to()`` to another device) are plain tensors, which the ops treat as raw tables.
    """

    page_size: int

    # Operations on a PageTable return plain tensors: a slice or a sum is not a page table.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, table: torch.Tensor, page_size: int) -> PageTable:
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype != torch.int32:
            got = f"{table.dtype} of shape {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table)
            raise ValueError(f"expected table to be an int32 tensor of shape [B, max_pages], got {got}")
        if not is_int(page_size) or page_size < 1:
            raise ValueError(f"expected page_size to be a positive int, got {page_size!r}")
        out = torch.Tensor._make_subclass(cls, table)
        out.page_size = page_size
        return out

    def __init__(self, table: torch.Tensor, page_size: int) -> None:
        pass  # all set in __new__


def to_page_table(
    token_table: torch.Tensor,
    page_size: int,
    *,
    seq_lens: torch.Tensor | None = None,
    check: bool = False,
) -> PageTable:
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
        ``[B, ceil(max_context / P)]`` int32 :class:`PageTable` (a tensor with ``page_size``):
        ``page_table[b, p] = token_table[b, p * P] // P``. Entries of pages past ``seq_lens`` are
        meaningless.
    """
    if not isinstance(token_table, torch.Tensor) or token_table.dim() != 2:
        got = tuple(token_table.shape) if isinstance(token_table, torch.Tensor) else type(token_table).__name__
        raise ValueError(f"expected token_table of shape [B, max_context], got {got}")
    if token_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expected token_table of dtype int32 or int64, got {token_table.dtype}")
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"expected page_size to be a positive int, got {page_size!r}")
    page_table = torch.div(token_table[:, ::page_size], page_size, rounding_mode="floor").to(torch.int32)
    if check:
        _check_page_aligned(token_table, page_table, page_size, seq_lens)
    return PageTable(page_table, page_size)


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
    that nobody holds raises, so double frees are caught where they happen. A cache's holds are
    marked (``retain(pages, cached=True)``, ``free(pages, cached=True)``), so that the pages whose
    only holder is the cache, which it can give up at once, are counted (:attr:`num_evictable`).

    Each call changes the pool completely or not at all: the new counts and free list are worked
    out first, and an exception while they are stored (an interrupt, ``MemoryError``) puts the old
    ones back before it propagates.
    """

    def __init__(self, num_pages: int):
        if not is_int(num_pages) or num_pages < 1:
            raise ValueError(f"expected num_pages to be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pops low ids first
        self._refs = [0] * num_pages
        self._cached = [False] * num_pages  # a cache is among the page's holders
        self._num_evictable = 0  # pages held by the cache alone

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Pages whose one holder is the cache: in use, yet reusable as soon as the cache lets go."""
        return self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not is_int(n) or n < 0:
            raise ValueError(f"expected a non-negative page count, got {n!r}")
        if n > len(self._free):
            raise OutOfPagesError(f"cannot allocate {n} pages: {len(self._free)} of {self.num_pages} are free")
        keep = len(self._free) - n
        pages = self._free[keep:][::-1]
        return self._commit(keep, [], dict.fromkeys(pages, 1), pages)  # no line between commit and return

    def retain(self, pages: list[int], cached: bool = False) -> None:
        """Add a holder to each page; ``cached``: the holder is the cache (at most one a page)."""
        pages = list(pages)
        for page in pages:
            self._check_held(page, "retain")
            if cached and self._cached[page]:
                raise ValueError(f"page {page} is cached already")
        if cached and len(set(pages)) < len(pages):
            raise ValueError(f"expected distinct pages for the cache to hold, got {pages}")
        refs: dict[int, int] = {}
        for page in pages:
            refs[page] = refs.get(page, self._refs[page]) + 1
        self._commit(len(self._free), [], refs, cached=dict.fromkeys(pages, True) if cached else None)

    def free(self, pages: list[int], cached: bool = False) -> None:
        """Drop a holder of each page; ``cached``: the holder is the cache."""
        pages = list(pages)
        if cached:
            for page in pages:
                self._check_id(page)
                if not self._cached[page]:
                    raise ValueError(f"page {page} is not cached")
        counts: dict[int, int] = {}
        for page in pages:
            counts[page] = counts.get(page, 0) + 1
        for page, n in counts.items():
            self._check_held(page, "free")
            if self._refs[page] < n:
                raise ValueError(f"double free of page {page}: it has {self._refs[page]} holder(s), freed {n}")
            if cached and n > 1:
                raise ValueError(f"page {page} is freed {n} times by the cache, which holds it once")
            if not cached and self._cached[page] and self._refs[page] - n < 1:
                raise ValueError(f"page {page} is held by the cache alone: free it with cached=True")
        refs: dict[int, int] = {}
        released = []
        for page in pages:
            refs[page] = refs.get(page, self._refs[page]) - 1
            if refs[page] == 0:
                released.append(page)
        self._commit(len(self._free), released, refs, cached=dict.fromkeys(pages, False) if cached else None)

    def ref_count(self, page: int) -> int:
        self._check_id(page)
        return self._refs[page]

    def _commit(self, keep: int, released: list[int], refs: dict[int, int], result=None, cached=None):
        """Make the free list ``free[:keep] + released``, set the counts ``refs`` and the cache marks
        ``cached`` (pages in ``refs``), and count the pages held by the cache alone: all, or none.

        Returns ``result``, so that a caller can return what it allocated in the commit's own line.
        """
        marks = cached or {}
        old_tail, old_refs = self._free[keep:], {page: self._refs[page] for page in refs}
        old_marks, old_evictable = {page: self._cached[page] for page in marks}, self._num_evictable
        evictable = old_evictable
        for page, count in refs.items():
            was, now = self._cached[page], marks.get(page, self._cached[page])
            evictable += (now and count == 1) - (was and self._refs[page] == 1)
        try:
            self._free[keep:] = released
            for page, count in refs.items():
                self._refs[page] = count
            for page, mark in marks.items():
                self._cached[page] = mark
            self._num_evictable = evictable
            return result  # inside the try: an interrupt at this line still rolls back
        except BaseException:
            self._free[keep:] = old_tail
            for page, count in old_refs.items():
                self._refs[page] = count
            for page, mark in old_marks.items():
                self._cached[page] = mark
            self._num_evictable = old_evictable
            raise

    def _check_id(self, page: int) -> None:
        if not is_int(page) or not 0 <= page < self.num_pages:
            raise ValueError(f"expected a page id in [0, {self.num_pages}), got {page!r}")

    def _check_held(self, page: int, action: str) -> None:
        self._check_id(page)
        if self._refs[page] == 0:
            verb = "double free of" if action == "free" else "cannot retain free"
            raise ValueError(f"{verb} page {page}: it is not allocated")
