"""Pages for sequences: allocation on :class:`portattn.PageAllocator`, and the prefix cache.

Prefix caching shares whole pages between sequences whose tokens agree up to the end of the page.
A full, computed page is keyed by a hash chained over the page's tokens and its prefix's key, so a
key names the entire prefix. A page that holds image placeholders also hashes those images' content
keys (``MultimodalData.content_key``), so equal token ids with different images never share a page.
The cache holds one reference on each page it indexes; a page that only the cache holds is
evictable, least recently used first.

Every update that touches the allocator and a record of who holds what (a sequence's ``pages``, a
cache entry) is all or nothing, also when an exception (an interrupt, ``MemoryError``) arrives
between two of its lines: the new pages or references are taken, then recorded in one statement,
and an exception before the record gives them back; a release that already reached the allocator
is completed. The allocator's own calls are all-or-nothing too (:class:`portattn.PageAllocator`).
Writes to ``req_to_token`` come before the record: columns a sequence does not own yet hold anything.
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
        self.num_cached_tokens = 0  # prompt tokens served from the cache to admitted sequences (the scheduler counts)

    # -- prefix cache ------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> tuple[list[bytes], list[int]]:
        """The keys and pages of a fresh sequence's longest cached prefix (nothing changed), leaving at least
        one token to compute, so that the step that finishes the prompt has logits."""
        if not self.enable_prefix_caching or seq.params.needs_prompt_logits:
            return [], []
        size, keys, pages = self.page_size, [], []
        for p in range((seq.num_tokens - 1) // size):
            key = sequence_page_key(seq, keys[-1] if keys else b"", p, size)
            page = self.cache.get(key)
            if page is None:
                break
            keys.append(key)
            pages.append(page)
        return keys, pages

    def cached_tokens(self, seq: Sequence) -> int:
        """The tokens :meth:`match_prefix` would give a fresh sequence now; nothing changes."""
        return len(self._cached_prefix(seq)[1]) * self.page_size

    def match_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached pages of its longest cached prefix; returns the tokens covered.

        At least one token is left to compute, so that the step that finishes the prompt has logits.
        """
        assert not seq.pages and seq.num_computed == 0
        keys, pages = self._cached_prefix(seq)
        if not pages:
            return 0
        for key in keys:
            self.cache.move_to_end(key)  # LRU order only
        self.req_pool.write_pages(seq.req_pool_idx, 0, pages)
        refs = self.allocator.ref_count(pages[0])
        try:
            self.allocator.retain(pages)
            seq.pages, seq.page_hashes, seq.num_computed = pages, keys, len(pages) * self.page_size
        except BaseException:
            if seq.pages is not pages and self.allocator.ref_count(pages[0]) > refs:
                self.allocator.free(pages)  # retained, not recorded
            raise
        return seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """Index the sequence's newly full, computed pages in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.page_size
        for p in range(len(seq.page_hashes), seq.num_computed // size):
            parent = seq.page_hashes[-1] if seq.page_hashes else b""
            key = sequence_page_key(seq, parent, p, size)
            if key not in self.cache:  # an equal page computed by another sequence stays private
                self._index(key, seq.pages[p])
            seq.page_hashes.append(key)

    def _index(self, key: bytes, page: int) -> None:
        """Add the cache's reference to ``page`` and its entry: both or neither."""
        refs = self.allocator.ref_count(page)
        try:
            self.allocator.retain([page], cached=True)
            self.cache[key] = page
        except BaseException:
            if key not in self.cache and self.allocator.ref_count(page) > refs:
                self.allocator.free([page], cached=True)
            raise

    def evict(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` least recently used pages that only the cache holds."""
        victims = []
        for key, page in self.cache.items():
            if len(victims) == num_pages:
                break
            if self.allocator.ref_count(page) == 1:
                victims.append(key)
        for key in victims:
            self._drop(key)
        return len(victims)

    def _drop(self, key: bytes) -> None:
        """Remove a cache entry and free its page (only the cache holds it): both, once started."""
        page = self.cache[key]
        try:
            del self.cache[key]
            self.allocator.free([page], cached=True)
        except BaseException:
            if key not in self.cache and self.allocator.ref_count(page) == 1:
                self.allocator.free([page], cached=True)
            raise

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
        old, num_free, pages = seq.pages, self.allocator.num_free, []
        try:
            pages = self.allocator.allocate(need)
            self.req_pool.write_pages(seq.req_pool_idx, len(old), pages)
            seq.pages = old + pages
        except BaseException:
            if seq.pages is old and self.allocator.num_free < num_free:
                self.allocator.free(pages)  # allocated, not recorded
            raise
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the sequence's pages past the first ``num_tokens`` tokens (with speculative
        decoding: pages that only rejected proposed tokens used; never a cached page, as a page enters
        the cache only once its tokens are verified)."""
        keep = num_pages_for(num_tokens, self.page_size)
        pages = seq.pages
        if len(pages) <= keep:
            return
        tail, num_free = pages[keep:], self.allocator.num_free
        try:
            self.allocator.free(tail)
            seq.pages = pages[:keep]
        except BaseException:
            if seq.pages is pages and self.allocator.num_free > num_free:
                seq.pages = pages[:keep]  # freed: finish the trim
            raise

    def release(self, seq: Sequence) -> None:
        """Return the sequence's pages (cached ones stay with the cache) and forget its KV."""
        pages = seq.pages
        refs = self.allocator.ref_count(pages[0]) if pages else 0
        try:
            self.allocator.free(pages)
            seq.pages, seq.page_hashes, seq.num_computed = [], [], 0
        except BaseException:
            if pages and seq.pages is pages and self.allocator.ref_count(pages[0]) < refs:
                seq.pages, seq.page_hashes, seq.num_computed = [], [], 0  # freed: finish the release
            raise

    def release_all(self, seq: Sequence) -> None:
        """:meth:`release` the pages, then free the request row; a no-op for a sequence that holds
        neither. All or nothing per step: an exception between two lines leaves what is freed marked
        freed, and a later call completes the rest."""
        self.release(seq)
        row, num_free = seq.req_pool_idx, self.req_pool.num_free
        if row is None:
            return
        try:
            self.req_pool.free(row)
            seq.req_pool_idx = None
        except BaseException:
            if self.req_pool.num_free > num_free:
                seq.req_pool_idx = None  # freed: finish the release
            raise
