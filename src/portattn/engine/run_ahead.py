"""Asynchronous scheduling: the next step is launched before the host reads this one's tokens.

A decode step whose sequences all sample inside its captured graph (``graph_sampling.py``) leaves its
sampled ids on the device, and so does an eager step (a prompt's chunk, beside decodes or not) whose
sampled tokens are all it gives the host (``ModelRunner.defers``: no prompt logits or
log-probabilities, no logits kept). With ``async_scheduling`` the engine launches such a step and
returns; the next :meth:`RunAhead.step` schedules and launches the step after it at once, each
sequence the launched step samples decoding the token in flight (``Scheduler.schedule_ahead``), whose
id it takes on the device from the launched step's (a decode graph's ``DecodeGraphs.launch(feed=...)``,
an eager step's inputs through ``ModelRunner.launch(feed=...)``); only then it waits for the launched
step's ids and appends them, checks stops and streams text, while the device runs the step after. The
host's work per token, a prompt's chunk included, then overlaps the device's instead of following it.

Between calls, a sequence of a launched step has ``num_computed == num_tokens``: the K/V of its last
token are computed (or being computed) and the token sampled after it is not yet in ``token_ids``, as
within a synchronous step before its tokens are appended. Its pages are committed to the prefix cache
only up to tokens the host knows.

A step is launched ahead only where the engine would schedule exactly that step from the known tokens:
the scheduler's own order and budget (decodes first, then prompt chunks and admissions), every
sequence with a token in flight drawing its next token by the draw alone (``samples_in_graph`` one
token ahead: no penalties, processors, bad words, log-probabilities or ``min_tokens`` ban, which would
need that token), no preemption (the pool holds the slot of each next token), no cascade and no
multimodal inputs. A sequence that certainly stops with the token in flight (``max_tokens`` or
``max_model_len`` reached) is left out of the step ahead; one that stops on a sampled stop token or
string has run one step too many, whose token is dropped and whose slot goes back with its pages (the
device writes it before any later step can reuse the page: one stream orders them), and a sequence
waiting for its place is then admitted one step later than synchronous scheduling would. Otherwise the
in-flight step's tokens are read and the next step is scheduled at once, before the call returns, and
launched without reading its tokens where it can be, so that the device runs it while the caller
handles the tokens read (streams them, takes new requests). Where a request needs the device read as
its step runs, the next step is left to the next call, which runs it synchronously. Outputs therefore
come one step later than they are computed; the tokens are those of synchronous scheduling.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .graph_sampling import samples_in_graph
from .graphs import longest_of
from .model_runner import Feed, Sampling
from .sequence import Sequence, Status

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(eq=False)
class Launched:
    """A decode step launched and not yet read: its sequences (one row each, in batch order), the
    handle of ``DecodeGraphs.launch``, and those of its sequences whose input id is the step before's
    sampled id (``fed``: their ``token_ids`` lack it until that step is read)."""

    seqs: list[Sequence]
    handle: tuple
    fed: list[Sequence] = field(default_factory=list)


@dataclass(eq=False)
class LaunchedEager:
    """A step of the eager forward (a prompt's chunk, beside decodes or not) launched and not yet read:
    ``ModelRunner.launch``'s tokens in flight to the host; ``fed`` as :class:`Launched`'s."""

    scheduled: list[tuple[Sequence, int]]
    sampling: Sampling
    fed: list[Sequence] = field(default_factory=list)

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
        self.eager_fed = 0  # eager steps launched before the previous step's tokens were read

    def step(self) -> list[Sequence]:
        """One call of :meth:`Engine.step`: returns the sequences that finished with the tokens read."""
        engine = self.engine
        launched = self.launched
        if launched is None:
            scheduled = engine.scheduler.schedule()
            if not scheduled:
                return []
            return self._start(scheduled)
        self.launched = None
        following = None
        try:
            following = self._launch_ahead(launched)
            finished = self._read(launched)
            if following is not None:  # the tokens its fed sequences decode are now known
                engine.mark_computed([(seq, 1) for seq in following.fed if seq.status is Status.RUNNING])
        except BaseException:
            self._abort(launched.seqs + (following.seqs if following is not None else []))
            raise
        if following is None:
            return finished + self._next()
        if any(seq.status is Status.RUNNING for seq in following.seqs):
            self.launched = following
        else:  # every sequence of it stopped: its tokens are dropped
            self._read(following)
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
        try:
            return self._read(launched)
        except BaseException:
            self._abort(launched.seqs)
            raise

    # -- what may run ahead ----------------------------------------------------------------------

    def _launchable(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether a scheduled step may be launched without reading its tokens: a decode step that
        samples in its captured graph."""
        runner = self.engine.runner
        if not all(n == 1 for _, n in scheduled) or runner.cascade_tokens(scheduled):
            return False  # (a cascade step runs synchronously)
        return runner.samples_in_graph(scheduled, runner.logit_rows(scheduled))

    def _launch_ahead(self, launched: Launched | LaunchedEager) -> Launched | LaunchedEager | None:
        """Launch the step after ``launched`` before its tokens are read, where it can be: scheduled as
        the scheduler would from the known tokens, each sequence ``launched`` samples decoding the
        token in flight (``Scheduler.schedule_ahead``), and launched as a decode graph fed from
        ``launched``'s ids on the device or an eager step that :meth:`ModelRunner.defers` with those ids
        fed into its inputs. None (nothing launched) where a sequence's next draw needs the token in
        flight (penalties, processors, bad words, ``min_tokens``, log-probabilities), the scheduler
        would preempt, or the step cannot be launched this way (a cascade, a graph not yet recorded, a
        multimodal step, prompt logits or kept logits); then the tokens are read first."""
        engine = self.engine
        runner = engine.runner
        if isinstance(launched, Launched):
            sampled, ids = launched.seqs, None  # (the graph's own ids)
        else:
            sampled, ids = launched.sampling.sampling, launched.sampling.ids
        fed: dict[Sequence, int] = {}
        for row, seq in enumerate(sampled):
            if seq.status is not Status.RUNNING or engine.at_length(seq, ahead=1):
                continue  # stops with the token in flight
            if not samples_in_graph(seq, ahead=1):
                return None  # its next draw needs the token in flight on the host
            fed[seq] = row
        scheduled = engine.scheduler.schedule_ahead(fed)
        if scheduled is None or runner.cascade_tokens(scheduled):
            return None
        try:
            if all(seq in fed for seq, _ in scheduled) and runner.replays(scheduled):
                if not runner.graphs.recorded(len(scheduled), longest=longest_of(scheduled, 1)):
                    return None  # (a graph captured lazily is recorded by a step that reads its ids from the host)
                following = self._launch(scheduled, [fed[seq] for seq, _ in scheduled], ids)
            else:
                rows = {seq: fed[seq] for seq, _ in scheduled if seq in fed}
                want = runner.logit_rows(scheduled, rows)
                if runner.multimodal or not runner.defers(want):
                    return None
                feed = Feed(runner.graphs.tokens if ids is None else ids, rows) if rows else None
                sampling = runner.launch(scheduled, want, 0, feed)
                engine.mark_computed([(seq, n) for seq, n in scheduled if seq not in rows])
                following = LaunchedEager(scheduled, sampling, list(rows))
                self.eager_ahead += 1
                self.eager_fed += bool(rows)
        except BaseException:
            self._abort([seq for seq, _ in scheduled])
            raise
        self.steps_ahead += 1
        return following

    # -- launching and reading -------------------------------------------------------------------

    def _launch(
        self, scheduled: list[tuple[Sequence, int]], feed: list[int] | None, feed_ids: torch.Tensor | None = None
    ) -> Launched:
        """Launch a decode step of ``scheduled`` (``feed``: each row's input id from the launched step's
        row, of ``feed_ids`` where that step ran eagerly; None: from ``token_ids``). A fresh launch's
        sequences count their tokens computed at once; those of a step ahead once the tokens before
        them are read."""
        engine = self.engine
        seqs = [seq for seq, _ in scheduled]
        try:
            handle = engine.runner.graphs.launch(seqs, feed, feed_ids=feed_ids)
            if feed is None:
                engine.mark_computed(scheduled)
        except BaseException:
            for seq in seqs:
                if seq.request_id in engine.requests:
                    engine.abort(seq.request_id)
            raise
        return Launched(seqs, handle, [] if feed is None else seqs)

    def _read(self, launched: Launched | LaunchedEager) -> list[Sequence]:
        """Wait for a launched step's tokens and append them; returns the sequences that stop."""
        if isinstance(launched, LaunchedEager):
            return self._take_eager(launched)
        return self._take(launched.seqs, self.engine.runner.graphs.collect(launched.handle))

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
