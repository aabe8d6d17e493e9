"""What rank 0 sends the other ranks each step, and how they rebuild the step from it.

Rank 0 runs the scheduler. Before each forward it sends a :class:`StepMessage`: for each scheduled
sequence its request row, where its new tokens start and the tokens themselves (its images, the
first time the sequence is sent), the rows that need logits, the ``req_to_token`` writes the
scheduler made since the last step (:class:`JournaledReqToTokenPool` records them) and the requests
that ended. The other ranks keep a mirror :class:`~portattn.engine.sequence.Sequence` per live
request (:class:`SequenceMirror`) and run the same :class:`~portattn.engine.model_runner.ModelRunner`
forward on it, so every rank plans the same batch over the same page table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ...runtime.multimodal import MultimodalData
from ..req_pool import ReqToTokenPool
from ..sampling_params import SamplingParams
from ..sequence import Sequence

STOP = "stop"  # the message that ends the other ranks' loop


@dataclass(frozen=True)
class SeqStep:
    """One scheduled sequence: ``tokens`` are its ``token_ids[start : start + n]``."""

    request_id: int
    req_pool_idx: int
    start: int
    tokens: list[int]
    multimodal: MultimodalData | None = None  # its images, sent with its first step only


@dataclass(frozen=True)
class StepMessage:
    seqs: list[SeqStep]
    logit_rows: list[int]  # rows of the forward's hidden states that need logits (every rank computes them)
    page_writes: list[tuple[int, int, list[int]]]  # (row, first page, pages) in the order rank 0 wrote them
    ended: list[int] = field(default_factory=list)  # request ids whose mirrors can go
    cascade: int = 0  # the shared prefix rank 0 attends through a cascade (ModelRunner.cascade_tokens)


@dataclass(frozen=True)
class CallMessage:
    """Run ``fn(engine, *args)`` on every rank (a module-level function); rank 0 returns its result."""

    fn: Callable
    args: tuple = ()


class JournaledReqToTokenPool(ReqToTokenPool):
    """A :class:`ReqToTokenPool` that records its page writes, for rank 0 to replay on the others."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.journal: list[tuple[int, int, list[int]]] = []

    def write_pages(self, row: int, first_page: int, pages: list[int]) -> None:
        super().write_pages(row, first_page, pages)
        if pages:
            self.journal.append((row, first_page, list(pages)))

    def take_journal(self) -> list[tuple[int, int, list[int]]]:
        journal, self.journal = self.journal, []
        return journal


class StepSender:
    """Rank 0's side: the message for one scheduled step."""

    def __init__(self, req_pool: JournaledReqToTokenPool):
        self.req_pool = req_pool
        self.known: set[int] = set()  # requests the other ranks hold mirrors of

    def message(
        self, scheduled: list[tuple[Sequence, int]], logit_rows: list[int], live: set[int], cascade: int = 0
    ) -> StepMessage:
        ended = sorted(self.known - live)
        self.known -= set(ended)
        seqs = []
        for seq, n in scheduled:
            start = seq.num_computed
            multimodal = None
            if seq.request_id not in self.known:
                self.known.add(seq.request_id)
                if seq.multimodal is not None:  # its images, before any embedding is computed (on the CPU)
                    data = seq.multimodal
                    multimodal = dataclasses.replace(data, pixel_values=data.pixel_values.cpu(), embeds=None)
            seqs.append(SeqStep(seq.request_id, seq.req_pool_idx, start, seq.token_ids[start : start + n], multimodal))
        return StepMessage(seqs, list(logit_rows), self.req_pool.take_journal(), ended, cascade)


class SequenceMirror:
    """The other ranks' side: mirror sequences and page table kept equal to rank 0's."""

    def __init__(self, req_pool: ReqToTokenPool):
        self.req_pool = req_pool
        self.seqs: dict[int, Sequence] = {}

    def apply(self, message: StepMessage) -> list[tuple[Sequence, int]]:
        """Replay the message's page writes and return the step's ``(sequence, new tokens)`` pairs."""
        for request_id in message.ended:
            self.seqs.pop(request_id, None)
        for row, first_page, pages in message.page_writes:
            self.req_pool.write_pages(row, first_page, pages)
        scheduled = []
        for step in message.seqs:
            seq = self.seqs.get(step.request_id)
            if seq is None:
                seq = Sequence(step.request_id, [], SamplingParams(temperature=0), multimodal=step.multimodal)
                self.seqs[step.request_id] = seq
            seq.req_pool_idx, seq.num_computed = step.req_pool_idx, step.start
            # What ForwardBatch reads is token_ids[start : start + n]; tokens before `start` (computed
            # in earlier steps, or cached pages of a prefix this rank never saw) are not read again.
            tokens = seq.token_ids
            del tokens[step.start :]
            tokens.extend([0] * (step.start - len(tokens)))
            tokens.extend(step.tokens)
            scheduled.append((seq, len(step.tokens)))
        return scheduled
