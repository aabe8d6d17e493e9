"""``req_to_token``: each request's KV slots, token-granular, and the free request rows."""

from __future__ import annotations

import numpy as np
import torch

from ..backends.base import TABLE_PAGES
from ..device import is_gpu


class ReqToTokenPool:
    """``req_to_token [max_reqs, max_context]`` int32 and its free rows.

    Token-granular: column ``i`` of a request's row is the slot of its token ``i``. ``max_context``
    is a multiple of the page size so that whole pages can always be written. The rows hold a multiple
    of ``TABLE_PAGES`` pages (the columns past ``max_context`` are never written): a step's page table,
    as wide as its longest sequence needs rounded up to ``TABLE_PAGES`` pages and at most a whole row,
    then always has a row stride Triton specializes (on an H200 an engine whose ``max_model_len`` was
    912 tokens, 57 pages, compiled four attention variants while serving, each holding up its step for
    about a second; benchmarks/results/engine_h200/round26/NOTES.md).
    """

    def __init__(self, max_reqs: int, max_context: int, page_size: int, device):
        if max_context % page_size:
            raise ValueError(f"expected max_context to be a multiple of page_size {page_size}, got {max_context}")
        self.page_size = page_size
        width = -(-max_context // (TABLE_PAGES * page_size)) * TABLE_PAGES * page_size
        self.req_to_token = torch.zeros((max_reqs, width), dtype=torch.int32, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))
        self._offsets = np.arange(page_size, dtype=np.int32)[None, :]  # a page's slots from its first

    @property
    def max_context(self) -> int:
        """The columns of a row (``max_context`` rounded up to ``TABLE_PAGES`` pages)."""
        return self.req_to_token.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)

    def write_pages(self, row: int, first_page: int, pages: list[int]) -> None:
        """Point logical pages ``first_page ..`` of ``row`` at the physical ``pages`` (page-aligned).

        The slots are computed on the host and written by one copy; on a GPU from pinned memory,
        asynchronously: the write is queued behind the device's work without waiting for it (a copy
        from pageable memory synchronizes the stream, which stalled the host until a step launched
        ahead by async scheduling had finished).
        """
        if not pages:
            return
        slots = torch.from_numpy((np.asarray(pages, dtype=np.int32)[:, None] * self.page_size + self._offsets).ravel())
        start = first_page * self.page_size
        dst = self.req_to_token[row, start : start + slots.shape[0]]
        if is_gpu(dst.device):
            dst.copy_(slots.pin_memory(), non_blocking=True)
        else:
            dst.copy_(slots)
