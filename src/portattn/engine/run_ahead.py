"""Asynchronous scheduling: the next step is launched before the host reads this one's tokens.

A decode step whose sequences all sample inside its captured graph (``graph_sampling.py``) leaves its
sampled ids on the device. With ``async_scheduling`` the engine launches it and returns; the next
:meth:`RunAhead.step` launches the step after it at once, its input ids taken on the device from the
launched step's (``DecodeGraphs.launch(feed=...)``), and only then waits for the launched step's ids
and appends them, checks stops and streams text, while the device runs the step after. The host's
work per token then overlaps the device's instead of following it.

Between calls, a sequence of a launched step has ``num_computed == num_tokens``: the K/V of its last
token are computed (or being computed) and the token sampled after it is not yet in ``token_ids``, as
within a synchronous step before its tokens are appended. Its pages are committed to the prefix cache
only up to tokens the host knows.

A step is launched ahead only where the engine would schedule exactly that step: every running
sequence decodes and samples in the graph, none waits for admission unless the step ahead is full
(``max_num_seqs`` sequences: the scheduler would admit none), the pool has the slot of each next
token. A sequence that certainly stops with the token in flight (``max_tokens`` or
``max_model_len`` reached) is left out of the step ahead; one that stops on a sampled stop token or
string has run one step too many, whose token is dropped and whose slot goes back with its pages
(the device writes it before any later step can reuse the page: one stream orders them), and a
sequence waiting for its place is then admitted one step later than synchronous scheduling would.
Otherwise the in-flight step's tokens are read and the next step is scheduled at once, before the call
returns, so that the device runs it while the caller handles the tokens read (streams them, takes new
requests, which a later step admits). That step is launched without reading its tokens too when it is
a decode step as above or an eager step (a prompt's chunk, beside decodes or not) whose sampled tokens
are all it gives the host (``ModelRunner.defers``: no prompt logits or log-probabilities, no logits
kept); the next call reads them. Where a request needs the device read as its step runs, the next
step is left to the next call, which runs it synchronously. Outputs therefore come one step later
than they are computed; the tokens are those of synchronous scheduling.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .graph_sampling import samples_in_graph
from .graphs import longest_of
from .model_runner import Sampling
from .sequence import Sequence, Status

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(eq=False)
class Launched:
    """A decode step launched and not yet read: its sequences (one row each, in batch order) and the
    handle of ``DecodeGraphs.launch``."""

    seqs: list[Sequence]
    handle: tuple


@dataclass(eq=False)
class LaunchedEager:
    """A step of the eager forward (a prompt's chunk, beside decodes or not) launched and not yet read:
    ``ModelRunner.launch``'s tokens in flight to the host."""

    scheduled: list[tuple[Sequence, int]]
    sampling: Sampling

    @property
    def seqs(self) -> list[Sequence]:
        return [seq for seq, _ in self.scheduled]


class RunAhead:
    """The engine's steps under ``async_scheduling`` (see the module's doc)."""

    def __init__(self, engine: Engine):
        if engine.runner.graphs is None or not engine.runner.graphs.feed:
            raise ValueError("expected decode graphs made with feed for async_scheduling, got none")
        self.engine = engine
        self.launched: Launched | LaunchedEager | None = None
        self.steps_ahead = 0  # steps launched before the previous step's tokens were read
        self.eager_ahead = 0  # eager steps launched before the caller had the tokens read before them

    def step(self) -> list[Sequence]:
        """One call of :meth:`Engine.step`: returns the sequences that finished with the tokens read."""
        engine = self.engine
        launched = self.launched
        if launched is None:
            scheduled = engine.scheduler.schedule()
            if not scheduled:
                return []
            return self._start(scheduled)
        if isinstance(launched, LaunchedEager):
            self.launched = None
            finished = self._take_eager(launched)
            return finished + self._next()
        ahead = self._ahead(launched)
        self.launched = None
        following = None
        try:
            if ahead is not None:
                following = self._launch(*ahead)
                self.steps_ahead += 1
            tokens = engine.runner.graphs.collect(launched.handle)
            finished = self._take(launched.seqs, tokens)
            if following is not None:  # its tokens' K/V are now those of known tokens
                engine.mark_computed([(seq, 1) for seq in following.seqs if seq.status is Status.RUNNING])
        except BaseException:
            for seq in launched.seqs + (following.seqs if following is not None else []):
                if seq.status is Status.RUNNING and seq.request_id in engine.requests:
                    engine.abort(seq.request_id)
            raise
        if following is not None and any(seq.status is Status.RUNNING for seq in following.seqs):
            self.launched = following
        elif following is not None:  # every sequence of it stopped: nothing to read
            engine.runner.graphs.collect(following.handle)
        if following is None:
            finished += self._next()
        return finished

    def _start(self, scheduled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Launch a scheduled step without reading its tokens where it can be (a decode step that
        samples in its graph, or an eager step whose tokens alone are read: ``ModelRunner.defers``);
        otherwise run it synchronously. Returns the sequences that finished (only a synchronous step's)."""
        engine = self.engine
        if self._launchable(scheduled):
            self.launched = self._launch(scheduled, None)
            return []
        runner = engine.runner
        want = runner.logit_rows(scheduled)
        if not runner.defers(want):
            return engine.run_step(scheduled)
        try:
            self.launched = LaunchedEager(scheduled, runner.launch(scheduled, want))
            engine.mark_computed(scheduled)
        except BaseException:
            self._abort([seq for seq, _ in scheduled])
            raise
        self.eager_ahead += 1
        return []

    def _next(self) -> list[Sequence]:
        """After reading the launched step's tokens with none launched behind it: the next step
        scheduled and launched at once (:meth:`_start`), so that the device runs it while the caller
        handles the tokens read, unless a sequence needs the device read while its step runs (prompt
        logits or log-probabilities, logits kept): then the next call schedules it."""
        scheduler = self.engine.scheduler
        if any(_reads_as_it_runs(seq) for seq in itertools.chain(scheduler.running, scheduler.waiting)):
            return []
        scheduled = scheduler.schedule()
        return self._start(scheduled) if scheduled else []

    def _take_eager(self, launched: LaunchedEager) -> list[Sequence]:
        """Read a launched eager step's tokens and append them (``Engine.run_step``'s part after the
        forward)."""
        engine = self.engine
        try:
            sampled = engine.runner.sampled(launched.sampling)
            finished = []
            for seq, (tokens, logprobs) in sampled.items():
                if seq.status is not Status.RUNNING:  # aborted meanwhile
                    continue
                reason = engine.append_tokens(seq, tokens, logprobs)
                if reason is not None:
                    engine.finish(seq, reason)
                    finished.append(seq)
        except BaseException:
            self._abort(launched.seqs)
            raise
        return finished

    def _abort(self, seqs: list[Sequence]) -> None:
        engine = self.engine
        for seq in seqs:
            if seq.status is Status.RUNNING and seq.request_id in engine.requests:
                engine.abort(seq.request_id)

    def settle(self) -> list[Sequence]:
        """Read the launched step's tokens, if a step is in flight, and launch none after it: the engine's
        next step is then scheduled from tokens the host knows (as a synchronous step is). Returns the
        sequences that finished with them."""
        launched, self.launched = self.launched, None
        if launched is None:
            return []
        if isinstance(launched, LaunchedEager):
            return self._take_eager(launched)
        engine = self.engine
        try:
            return self._take(launched.seqs, engine.runner.graphs.collect(launched.handle))
        except BaseException:
            for seq in launched.seqs:
                if seq.status is Status.RUNNING and seq.request_id in engine.requests:
                    engine.abort(seq.request_id)
            raise

    # -- what may run ahead ----------------------------------------------------------------------

    def _launchable(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether a scheduled step may be launched without reading its tokens: a decode step that
        samples in its captured graph."""
        runner = self.engine.runner
        if not all(n == 1 for _, n in scheduled) or runner.cascade_tokens(scheduled):
            return False  # (a cascade step runs synchronously)
        return runner.samples_in_graph(scheduled, runner.logit_rows(scheduled))

    def _ahead(self, launched: Launched) -> tuple[list[tuple[Sequence, int]], list[int]] | None:
        """The step after ``launched`` as the scheduler would make it, with each sequence's row in
        ``launched`` (its input id), or None when that step needs the tokens first."""
        engine = self.engine
        scheduler = engine.scheduler
        live = [seq for seq in launched.seqs if seq.status is Status.RUNNING]
        if len(scheduler.running) != len(live) or set(scheduler.running) != set(live):
            return None  # sequences outside the launched step (a prefill to go on)
        rows = {seq: row for row, seq in enumerate(launched.seqs)}
        going = []
        for seq in live:
            if engine.at_length(seq, ahead=1):
                continue  # stops with the token in flight
            if not samples_in_graph(seq, ahead=1):
                return None  # its next token needs the eager sampler
            going.append(seq)
        budget = scheduler.token_budget
        if not going or (budget is not None and len(going) > budget):
            return None
        if scheduler.waiting and len(going) < scheduler.max_num_seqs:
            return None  # the scheduler would admit a waiting sequence into the next step
        scheduled = [(seq, 1) for seq in going]
        runner = engine.runner
        if runner.cascade_tokens(scheduled) or not runner.replays(scheduled):
            return None
        if not runner.graphs.recorded(len(going), longest=longest_of(scheduled, 1)):
            return None  # (a graph captured lazily is recorded by a step that reads its ids from the host)
        for seq in going:
            if not engine.pages.reserve(seq, seq.num_computed + 1):
                return None  # the pool is short: the scheduler decides (it may preempt)
        return scheduled, [rows[seq] for seq in going]

    # -- launching and reading -------------------------------------------------------------------

    def _launch(self, scheduled: list[tuple[Sequence, int]], feed: list[int] | None) -> Launched:
        """Launch a decode step of ``scheduled`` (``feed``: each row's input id from the launched step's
        row, None: from ``token_ids``). A fresh launch's sequences count their tokens computed at once;
        those of a step ahead once the tokens before them are read."""
        engine = self.engine
        seqs = [seq for seq, _ in scheduled]
        try:
            handle = engine.runner.graphs.launch(seqs, feed)
            if feed is None:
                engine.mark_computed(scheduled)
        except BaseException:
            for seq in seqs:
                if seq.request_id in engine.requests:
                    engine.abort(seq.request_id)
            raise
        return Launched(seqs, handle)

    def _take(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append the launched step's tokens to its sequences that still run; returns those that stop."""
        engine = self.engine
        finished = []
        for seq, token in zip(seqs, tokens):
            if seq.status is not Status.RUNNING:  # aborted meanwhile
                continue
            reason = engine.append_tokens(seq, [token], None)
            if reason is not None:
                engine.finish(seq, reason)
                finished.append(seq)
        return finished


def _reads_as_it_runs(seq: Sequence) -> bool:
    """Whether a step of ``seq`` reads the device while it runs (``ModelRunner.defers`` is false)."""
    params = seq.params
    return params.return_logits or (params.needs_prompt_logits and seq.num_prompt_scored < seq.num_prompt_tokens)
