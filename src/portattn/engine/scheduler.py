"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Every step has a token budget, ``max_num_batched_tokens`` (vLLM's name and meaning). The running
sequences in decode (one new token each) come first, oldest first, so that a long prompt never
stalls them; then the running sequences still prefilling take chunks of what is left, oldest first;
then waiting ones are admitted while there is a free request slot and budget. A sequence's share is
``min(uncomputed tokens, budget left)``, so one forward can mix decodes, prompt chunks and whole
prefills, and no forward computes more than the budget. With ``long_prefill_token_threshold`` (vLLM's
name; 0: none) a prompt's share is also at most that many tokens a step: a long prompt then joins the
running decodes in small chunks (each step barely longer than a decode step). Where the capped chunks
would fill the budget anyway (a queue of prompts), the cap cannot shorten the step, only spread it over
more prompts, each of whose first tokens would then come later: a prompt whose remaining tokens fit in
what is left then computes them all (the step is as long as the capped one; a prompt too long to
finish still takes its capped chunk, so shorter ones go on beside it). With ``max_num_partial_prefills``
(vLLM's name and meaning; 0: no limit) at most that many prompts compute a chunk that does not finish them in
one step, oldest first: a prompt beyond them computes only if all it has left fits in its share (it waits
otherwise, and so does admission), so that prompts arriving together enter the running decodes one after
another instead of all lengthening the same steps. Whether the capped chunks fill the step is decided without
this limit: where they would, prompts that fit still finish whole, as above. When the pool runs out of pages,
the newest running sequence is preempted (a decode already scheduled this step is taken back out): its
pages go back to the pool and it recomputes later from its tokens, which it keeps.

With speculative decoding, ``lookahead(seq)`` (set per step by the engine) adds the tokens a running
sequence in decode may propose to its share; when the pool cannot hold a sequence's tokens, its own
proposals, then those of the sequences scheduled before it, give way (their pages go back) before
anything is preempted.

Admission, preemption and finishing are each all or nothing, also when an exception (an interrupt,
``MemoryError``) arrives between two of their lines: a sequence is in exactly one queue (or
finished), and holds a request row and pages exactly while it is running. A half-done admission is
undone; a half-done release is completed.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Collection

from .page_manager import PageManager
from .sequence import Sequence, Status

logger = logging.getLogger("portattn")


class Scheduler:
    def __init__(
        self,
        page_manager: PageManager,
        max_num_seqs: int,
        max_num_batched_tokens: int | None,
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 0,
    ):
        self.pages = page_manager
        self.req_pool = page_manager.req_pool
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens  # None: no limit
        self.chunk_cap = long_prefill_token_threshold or float("inf")  # a prompt's tokens a step
        self.max_partial = max_num_partial_prefills or float("inf")  # prompts a step left unfinished
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.lookahead: Callable[[Sequence], int] | None = None  # speculative decoding's proposals

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next forward: ``(sequence, number of new tokens)`` pairs, in batch order."""
        return self._schedule(frozenset())

    def schedule_ahead(self, in_flight: Collection[Sequence]) -> list[tuple[Sequence, int]] | None:
        """The next forward while a launched step samples the next token of each running sequence of
        ``in_flight`` (its ``token_ids`` lack it; ``num_computed == num_tokens``): each decodes that token
        (one new token at position ``num_tokens``, whose slot is reserved), the others as :meth:`schedule`
        has them. None, with nothing admitted, where that step would preempt or holds nothing: the
        synchronous schedule decides then, from tokens the host knows. A running sequence outside
        ``in_flight`` with nothing to compute (one that stops with its token in flight) is left out."""
        return self._schedule(frozenset(in_flight), ahead=True)

    def _schedule(self, in_flight: frozenset[Sequence], ahead: bool = False) -> list[tuple[Sequence, int]] | None:
        budget = self.token_budget if self.token_budget is not None else float("inf")
        chosen: dict[Sequence, int] = {}  # in batch order
        preempted: set[Sequence] = set()

        uncomputed = {seq: seq.num_tokens - seq.num_computed for seq in self.running}
        for seq in in_flight:  # (its token in flight is the one it computes)
            uncomputed[seq] = 1
        decoding = [seq for seq in self.running if uncomputed[seq] == 1]
        prefilling = [seq for seq in self.running if uncomputed[seq] > 1]
        full = None  # whether capped prompt chunks fill the step (decided at the first prompt)
        partial = 0  # prompts whose chunk this step does not finish them
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq in preempted:  # preempted for an older sequence's pages
                continue
            pending = uncomputed[seq]
            if pending > 1 and full is None:
                full = self._capped_prompts_fill(budget, [uncomputed[s] for s in prefilling if s not in preempted])
            left = pending if pending == 1 else self._chunk(pending, budget, full, self.max_partial - partial)
            if left < pending:  # a partial prefill
                if partial >= self.max_partial:
                    continue
                partial += 1
            n = int(min(left + self._lookahead(seq, pending), budget))
            while not self.pages.reserve(seq, seq.num_computed + n):
                if ahead:
                    return None  # (the pages reserved so far are those the sequences need next anyway)
                if n > left:  # the proposals give way first: this sequence's,
                    n = int(min(left, budget))
                    continue
                freed = self._drop_lookahead(chosen)  # then those of the sequences chosen before it
                if freed:
                    budget += freed
                    continue
                victim = self.running[-1]
                budget += chosen.pop(victim, 0)
                self._preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            else:
                chosen[seq] = n
                budget -= n
        scheduled = list(chosen.items())
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if full is None:
                full = self._capped_prompts_fill(budget, [])
            n = self._admit(seq, budget, full, self.max_partial - partial)
            if n is None:
                break
            partial += n < seq.num_tokens - seq.num_computed
            scheduled.append((seq, n))
            budget -= n
        if not scheduled and ahead:
            return None
        if not scheduled and self.has_unfinished():
            raise RuntimeError("the page pool cannot hold the oldest sequence on its own; raise num_pages")
        return scheduled

    def _capped_prompts_fill(self, room: float, running_prompts: list[int]) -> bool:
        """Whether the prompts' chunks, each capped at ``long_prefill_token_threshold``, would fill the
        ``room`` the decodes leave: the running prompts' uncomputed token counts, then the waiting ones
        that a free request slot could admit (their tokens less those the prefix cache holds)."""
        if self.chunk_cap == float("inf"):
            return False
        total, slots = 0, max(0, self.max_num_seqs - len(self.running))
        for pending in running_prompts:
            total += min(pending, self.chunk_cap)
            if total >= room:
                return True
        for seq in itertools.islice(self.waiting, slots):
            total += min(seq.num_tokens - self.pages.cached_tokens(seq), self.chunk_cap)
            if total >= room:
                return True
        return False

    def _chunk(self, pending: int, budget: float, full: bool, partial_left: float = float("inf")) -> int:
        """The tokens a prompt with ``pending`` uncomputed ones computes this step, ``budget`` left: at most
        ``long_prefill_token_threshold``, unless the capped chunks fill the step either way (``full``) and the
        rest of this prompt fits in it. The step is then exactly as long, and the prompts finish oldest first
        instead of all advancing a chunk at a time (which would delay every first token); a prompt too long to
        finish still takes only its chunk, so shorter ones behind it go on beside it, unless it is the last
        prompt ``max_num_partial_prefills`` lets go unfinished (``partial_left``, the prompts it still lets go
        unfinished this step, at most 1): no prompt behind it could then take a chunk, and it takes all that is
        left (a step as long as the capped chunks would have made it)."""
        if full and (pending <= budget or partial_left <= 1):
            return int(min(pending, budget))
        return int(min(pending, budget, self.chunk_cap))

    def _lookahead(self, seq: Sequence, uncomputed: int) -> int:
        """Proposed tokens ``seq`` is scheduled for: only in decode (one token to compute, output started)."""
        if self.lookahead is None or uncomputed != 1 or seq.num_output_tokens == 0:
            return 0
        return self.lookahead(seq)

    def _drop_lookahead(self, chosen: dict[Sequence, int]) -> int:
        """Take the proposed tokens back from the ``chosen`` sequences that have them (each runs its one
        token) and give back the pages only they needed; returns the tokens freed from the budget."""
        freed = 0
        for seq, n in chosen.items():
            uncomputed = seq.num_tokens - seq.num_computed
            if n > uncomputed:
                self.pages.trim(seq, seq.num_tokens)
                chosen[seq] = uncomputed
                freed += n - uncomputed
        return freed

    def _admit(
        self, seq: Sequence, budget: float, full: bool = False, partial_left: float = float("inf")
    ) -> int | None:
        """Move the head of ``waiting`` to ``running`` with a request row and pages for its first
        tokens; returns how many it computes now (``full``, ``partial_left``: as :meth:`_chunk`), or ``None``
        (nothing changed) if the pool is short or, where no more prompts may be left unfinished this step, those
        tokens would not finish its prompt."""
        if partial_left <= 0:  # (decided before anything is taken: it waits every step the limit holds)
            pending = seq.num_tokens - self.pages.cached_tokens(seq)
            if self._chunk(pending, budget, full) < pending:
                return None
        try:
            seq.req_pool_idx = self.req_pool.alloc()
            cached = self.pages.match_prefix(seq)
            n = self._chunk(seq.num_tokens - seq.num_computed, budget, full, partial_left)
            if not self.pages.reserve(seq, seq.num_computed + n):
                self._release(seq)
                return None
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            self.pages.num_cached_tokens += cached  # hits of an admission, not of each attempt
        except BaseException:
            if seq not in self.running:  # not admitted: back at the head of waiting, holding nothing
                self._release(seq)
                seq.status = Status.WAITING
                if seq not in self.waiting:
                    self.waiting.appendleft(seq)
            raise
        return n

    def finish(self, seq: Sequence, reason: str) -> None:
        try:
            self._release(seq)
            seq.status, seq.finish_reason = Status.FINISHED, reason
            self._dequeue(seq)
        except BaseException:  # complete it: a finished sequence holds nothing and is in no queue
            self._release(seq)
            seq.status, seq.finish_reason = Status.FINISHED, reason
            self._dequeue(seq)
            raise

    def _dequeue(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Move the newest running sequence back to the front of ``waiting``, holding nothing."""
        try:
            self._release(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(self.running.pop())
        except BaseException:  # complete it
            if seq not in self.waiting:
                self._release(seq)
                seq.status = Status.WAITING
                self._dequeue(seq)
                self.waiting.appendleft(seq)
            raise
        seq.num_preemptions += 1
        self.num_preemptions += 1
        logger.info(
            "preempted request %s (out of KV pages); %d preemptions so far",
            seq.request_id,
            self.num_preemptions,
        )

    def _release(self, seq: Sequence) -> None:
        """Give back the sequence's pages and request row; a no-op for one that holds neither."""
        self.pages.release_all(seq)
