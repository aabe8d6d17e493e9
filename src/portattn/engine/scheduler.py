"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Every step walks the running sequences first (oldest first: prefill chunks, then decodes of one
token each), then admits waiting ones while there is a free request slot and token budget. A
sequence's share is ``min(uncomputed tokens, budget left)``, so one forward can mix prefills,
prompt chunks (``chunked_prefill_size``) and decodes. When the pool runs out of pages, the newest
running sequence is preempted: its pages go back to the pool and it recomputes later from its
tokens, which it keeps.
"""

from __future__ import annotations

import logging
from collections import deque

from .page_manager import PageManager
from .sequence import Sequence, Status

logger = logging.getLogger("portattn")


class Scheduler:
    def __init__(self, page_manager: PageManager, max_num_seqs: int, chunked_prefill_size: int | None):
        self.pages = page_manager
        self.req_pool = page_manager.req_pool
        self.max_num_seqs = max_num_seqs
        self.token_budget = chunked_prefill_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next forward: ``(sequence, number of new tokens)`` pairs, in batch order."""
        budget = self.token_budget if self.token_budget is not None else float("inf")
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = int(min(seq.num_tokens - seq.num_computed, budget))
            while not self.pages.reserve(seq, seq.num_computed + n):
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.req_pool_idx = self.req_pool.alloc()
            self.pages.match_prefix(seq)
            n = int(min(seq.num_tokens - seq.num_computed, budget))
            if not self.pages.reserve(seq, seq.num_computed + n):
                self._release(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        if not scheduled and self.has_unfinished():
            raise RuntimeError("the page pool cannot hold the oldest sequence on its own; raise num_pages")
        return scheduled

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.req_pool_idx is not None:
            self._release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.info(
            "preempted request %s (out of KV pages); %d preemptions so far",
            seq.request_id,
            self.num_preemptions,
        )

    def _release(self, seq: Sequence) -> None:
        self.pages.release(seq)
        self.req_pool.free(seq.req_pool_idx)
        seq.req_pool_idx = None
