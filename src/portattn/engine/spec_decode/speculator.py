"""The engine's side of speculative decoding (rank 0): which sequences speculate, their proposals,
the verification, and what is kept afterwards.

One engine step with speculation::

    before_schedule   a sequence in decode (one token to compute, its output started) is scheduled
                      for 1 + k tokens (k = num_speculative_tokens, fewer near max_model_len or when
                      the token budget or the page pool is short: speculation gives way before a
                      preemption); none when more than disable_by_batch_size sequences run
    propose           the proposer's tokens (padded to the scheduled count with the last token, a
                      point-mass proposal like any other) are appended to token_ids and counted in
                      num_draft_tokens: a step of such sequences is a uniform step of k + 1 tokens
    forward           one target forward; the runner hands each verified sequence's k + 1 rows of
                      logits to verify (rejection.py)
    accept, settle    the proposal leaves token_ids, the emitted tokens are appended one by one
                      through the engine's stop checks (tokens after a stop are dropped), the K/V of
                      the kept tokens count as computed, pages only rejected tokens used go back to
                      the pool, full pages of verified tokens enter the prefix cache, and the
                      proposer catches up

Sequences still prefilling are scheduled as without speculation, in the same step (a step that
mixes them with verifications runs eagerly).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..page_manager import PageManager
from ..sequence import Sequence
from .config import SpeculativeConfig
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .rejection import Emitted, verify

logger = logging.getLogger("portattn")


@dataclass
class SpecDecodeStats:
    """vLLM's speculative-decoding counters: proposals (sequences that proposed tokens in a step),
    proposed tokens, accepted proposed tokens, and accepted tokens by position in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposed tokens / proposed tokens (0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    """Speculative decoding for one engine: ``proposer`` proposes (:class:`NgramProposer` or the
    draft model's), ``pages`` is the engine's page manager, ``max_model_len`` its ``max_model_len``."""

    def __init__(self, config: SpeculativeConfig, proposer, pages: PageManager, max_model_len: int, eos_token_ids):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.pages = pages
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self.enabled = True  # False while disable_by_batch_size holds speculation off
        self.paused = False  # True while the engine warms up (every rank must run the same steps)
        self.proposed: dict[Sequence, int] = {}  # this step's proposal lengths, before padding
        self.draft_probs: dict[Sequence, torch.Tensor | None] = {}

    def reset_stats(self) -> None:
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)

    # -- scheduling ------------------------------------------------------------------------------

    def lookahead(self, seq: Sequence) -> int:
        """Tokens ``seq`` (in decode) may propose: ``k``, fewer where max_model_len is near (the
        verified tokens' positions stay below ``max_model_len - 1``, as plain decoding's do)."""
        return max(0, min(self.k, self.max_model_len - 1 - seq.num_tokens))

    def before_schedule(self, scheduler) -> None:
        """Give the scheduler :meth:`lookahead`, or none in a step that does not speculate."""
        limit = self.config.disable_by_batch_size
        running = len(scheduler.running)
        enabled = limit is None or running <= limit
        if enabled != self.enabled:
            state = "on again" if enabled else "off"
            logger.info(
                "speculative decoding %s: %d running sequences, disable_by_batch_size %s", state, running, limit
            )
            self.enabled = enabled
        scheduler.lookahead = self.lookahead if enabled and not self.paused else None

    # -- the step --------------------------------------------------------------------------------

    def propose(self, scheduled: list[tuple[Sequence, int]], running: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Append the proposals of the sequences scheduled for more tokens than they have uncomputed;
        returns the step (as scheduled, or, when no sequence has a proposal, a plain decode step)."""
        self.proposer.release({seq.request_id for seq in running})
        requests = [(seq, n - 1) for seq, n in scheduled if n > seq.num_tokens - seq.num_computed]
        if not requests:
            return scheduled
        proposals = self.proposer.propose(requests)
        if not any(tokens for tokens, _ in proposals):  # nothing to verify: one token each, as without
            shrunk = {seq for seq, _ in requests}
            return [(seq, 1 if seq in shrunk else n) for seq, n in scheduled]
        for (seq, k), (tokens, probs) in zip(requests, proposals):
            tokens = list(tokens[:k])
            real = len(tokens)
            filler = tokens[-1] if tokens else seq.token_ids[-1]
            if probs is not None and real < k:  # the filler's proposal is a point mass too
                pad = torch.zeros(k - real, probs.shape[-1], dtype=probs.dtype, device=probs.device)
                probs = torch.cat([probs[:real], pad.index_fill_(1, torch.tensor([filler], device=probs.device), 1)])
            self.proposed[seq], self.draft_probs[seq] = real, probs
            seq.token_ids += tokens + [filler] * (k - real)
            seq.num_draft_tokens = k
        return scheduled

    def verify(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[Sequence, Emitted]:
        """The runner's verifier (see ``ModelRunner.verifier``)."""
        return verify(logits, seqs, [self.draft_probs.get(seq) for seq in seqs], self.eos_token_ids)

    def accept(self, seq: Sequence, emitted: list[int]) -> None:
        """Take the proposal out of ``seq`` before its ``emitted`` tokens are appended: ``seq`` is then as
        after a plain decode forward (its last token computed), and the counters count the run."""
        d = seq.num_draft_tokens
        del seq.token_ids[len(seq.token_ids) - d :]
        seq.num_draft_tokens = 0
        seq.num_computed -= d
        self.draft_probs.pop(seq, None)
        proposed = self.proposed.pop(seq, 0)
        if proposed:
            self.stats.record(proposed, min(len(emitted) - 1, proposed))

    def settle(self, seq: Sequence) -> None:
        """After the engine appended what it kept of the emitted tokens: pages past them go back, full
        pages of verified tokens enter the prefix cache, the proposer catches up."""
        self.pages.trim(seq, seq.num_tokens)
        self.pages.commit(seq)
        if seq.params.return_logits:
            del seq.logits[seq.num_output_tokens :]  # the logits of tokens dropped after a stop
        verified = getattr(self.proposer, "verified", None)
        if verified is not None:
            verified(seq)

    def discard(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After a step that raised: the proposals not yet verified leave their sequences."""
        for seq, _ in scheduled:
            if seq.num_draft_tokens:
                del seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
                seq.num_draft_tokens = 0
        self.proposed.clear()
        self.draft_probs.clear()

    def release(self, running: list[Sequence]) -> None:
        """Forget what the proposer keeps for requests that no longer run."""
        self.proposer.release({seq.request_id for seq in running})


def build_speculator(config: SpeculativeConfig, engine, draft_model=None, *, capture_graphs: bool) -> Speculator:
    """The speculator of ``engine`` (rank 0's, built): an n-gram proposer, or one over ``draft_model``
    (:func:`.draft_model.load_draft_model`)."""
    if config.method == "ngram":
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        logger.info(
            "speculative decoding: n-gram, %d tokens, n-grams of %d to %d",
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
        )
    else:
        proposer = DraftModelProposer(
            config,
            draft_model,
            engine.config,
            max_model_len=engine.max_model_len,
            num_pages=engine.allocator.num_pages,
            eos_token_ids=frozenset(engine.eos_token_ids),
            capture_graphs=capture_graphs,
        )
    if config.disable_by_batch_size is not None:
        logger.info(
            "speculative decoding pauses in steps that start with more than %d running sequences "
            "(disable_by_batch_size; null speculates at every batch size)",
            config.disable_by_batch_size,
        )
    return Speculator(config, proposer, engine.pages, engine.max_model_len, frozenset(engine.eos_token_ids))
