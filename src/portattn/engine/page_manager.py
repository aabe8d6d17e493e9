"""Pages for sequences: allocation on :class:`portattn.PageAllocator`, and the prefix cache.

Prefix caching shares whole pages between sequences whose tokens agree up to the end of the page.
A full, computed page is keyed by a hash chained over the page's tokens and its prefix's key, so a
key names the entire prefix. A page that holds image placeholders also hashes those images' content
keys (``MultimodalData.content_key``), so equal token ids with different images never share a page.
The cache holds one reference on each page it indexes; a page that only the cache holds is
evictable, least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ..paging import PageAllocator, num_pages_for
from .req_pool import ReqToTokenPool
from .sequence import Sequence


def page_key(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes() + extra, digest_size=16).digest()


def sequence_page_key(seq: Sequence, parent: bytes, page: int, page_size: int) -> bytes:
    """The key of the sequence's logical page ``page``, chained on ``parent`` (the previous page's key)."""
    first, last = page * page_size, (page + 1) * page_size
    extra = seq.multimodal.content_key(first, last) if seq.multimodal is not None else b""
    return page_key(parent, seq.token_ids[first:last], extra)


class PageManager:
    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, enable_prefix_caching: bool):
        self.allocator = allocator
        self.req_pool = req_pool
        self.page_size = req_pool.page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache: OrderedDict[bytes, int] = OrderedDict()  # key -> page, oldest use first
        self.num_cached_tokens = 0  # prompt tokens served from the cache, over the engine's life

    # -- prefix cache ------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached pages of its longest cached prefix; returns the tokens covered.

        At least one token is left to compute, so that the step that finishes the prompt has logits.
        """
        assert not seq.pages and seq.num_computed == 0
        if not self.enable_prefix_caching or seq.params.needs_prompt_logits:
            return 0
        size, parent = self.page_size, b""
        for p in range((seq.num_tokens - 1) // size):
            key = sequence_page_key(seq, parent, p, size)
            page = self.cache.get(key)
            if page is None:
                break
            self.cache.move_to_end(key)
            seq.pages.append(page)
            seq.page_hashes.append(key)
            parent = key
        self.allocator.retain(seq.pages)
        self.req_pool.write_pages(seq.req_pool_idx, 0, seq.pages)
        seq.num_computed = len(seq.pages) * size
        self.num_cached_tokens += seq.num_computed
        return seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """Index the sequence's newly full, computed pages in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.page_size
        for p in range(len(seq.page_hashes), seq.num_computed // size):
            parent = seq.page_hashes[-1] if seq.page_hashes else b""
            key = sequence_page_key(seq, parent, p, size)
            seq.page_hashes.append(key)
            if key not in self.cache:  # an equal page computed by another sequence stays private
                self.cache[key] = seq.pages[p]
                self.allocator.retain([seq.pages[p]])

    def evict(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` least recently used pages that only the cache holds."""
        victims = []
        for key, page in self.cache.items():
            if len(victims) == num_pages:
                break
            if self.allocator.ref_count(page) == 1:
                victims.append(key)
        for key in victims:
            self.allocator.free([self.cache.pop(key)])
        return len(victims)

    def clear_cache(self) -> None:
        self.evict(len(self.cache))

    # -- allocation --------------------------------------------------------------------------

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence's pages cover ``num_tokens`` tokens; ``False`` if the pool cannot."""
        need = num_pages_for(num_tokens, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if self.allocator.num_free < need:
            self.evict(need - self.allocator.num_free)
            if self.allocator.num_free < need:
                return False
        pages = self.allocator.allocate(need)
        self.req_pool.write_pages(seq.req_pool_idx, len(seq.pages), pages)
        seq.pages.extend(pages)
        return True

    def release(self, seq: Sequence) -> None:
        """Return the sequence's pages (cached ones stay with the cache) and forget its KV."""
        self.allocator.free(seq.pages)
        seq.pages, seq.page_hashes, seq.num_computed = [], [], 0
