"""Verification of proposed tokens by rejection sampling, which keeps the target's distribution exactly.

A sequence that proposed ``d`` tokens ``x_1 .. x_d`` after its ``L`` tokens is verified by one forward
of ``d + 1`` tokens; row ``i`` of its logits is the target's distribution of token ``L + i`` given
the first ``L + i`` tokens. Each row is processed exactly as the plain sampler processes the logits
of that position (:mod:`..sampler`): the logits processors, ``allowed_token_ids``, bans and
penalties see the sequence as it is at that row (:class:`SequencePrefix`), then temperature,
``min_p``, ``top_k``, ``top_p`` give ``p_i``. Row ``i < d`` decides ``x_{i+1}``:

* greedy: accepted iff it is the argmax of the processed logits; the first rejected row emits the
  argmax. The emitted tokens are plain greedy decoding's.
* a point-mass proposal (prompt lookup, greedy drafts): a token ``y_i`` is drawn from ``p_i`` with the
  plain sampler's own noise at that position, and ``x_{i+1}`` is accepted iff ``y_i == x_{i+1}``;
  the first rejected row emits ``y_i``. This is the standard test (accept with probability
  ``min(1, p(x) / 1) = p(x)``; a rejection leaves ``y ~ p`` without ``x``, i.e. ``max(0, p - q)``
  normalised), and it reproduces plain decoding with the same seed token for token.
* a draft distribution ``q_i`` (a draft model that sampled ``x_{i+1} ~ q_i``): accepted iff
  ``u <= p_i(x) / q_i(x)`` for a uniform ``u``; the first rejected row emits a draw from
  ``max(0, p_i - q_i)`` normalised.

When all ``d`` are accepted, row ``d`` emits a bonus token drawn from ``p_d`` as the plain sampler
draws it. Every variate is counter-based (the request's key, the token's position and a purpose),
so the verification of given proposals is reproducible and independent of the batch (point-mass
proposals give a seeded request's plain tokens; a draft distribution's outcome also depends on the
proposals and ``q``, i.e. on what the draft computed). Everything is batched over all rows on the
device; the results cross to the host once.
"""

from __future__ import annotations

import torch

from ..sampler import (
    SamplingBatch,
    TokenLogprobs,
    apply_logits_processors,
    apply_penalties,
    draw,
    filter_logits,
    gumbel_argmax,
    to_host,
    token_logprobs,
    uniform_noise,
    unpack_logprobs,
)
from ..sequence import Sequence

# Purposes of the variates besides the plain sampler's draw: keys are xor-ed with these (< 2^62).
ACCEPT_SALT = 0x2C1B3C6D4E5F6071
RESIDUAL_SALT = 0x1A2B3C4D5E6F7081
DRAFT_SALT = 0x3F1E2D3C4B5A6978

Emitted = tuple[list[int], list[TokenLogprobs] | None]


class SequencePrefix:
    """``seq`` as it was when it held its first ``length`` tokens: what the sampler reads of a
    sequence (:meth:`SamplingBatch.build`) for one position of a verification or drafting step."""

    __slots__ = ("_tokens", "num_tokens", "seq")

    def __init__(self, seq: Sequence, length: int):
        self.seq, self.num_tokens, self._tokens = seq, length, None

    params = property(lambda self: self.seq.params)
    sample_key = property(lambda self: self.seq.sample_key)
    bad_word_ids = property(lambda self: self.seq.bad_word_ids)
    prompt_token_ids = property(lambda self: self.seq.prompt_token_ids)
    num_prompt_tokens = property(lambda self: self.seq.num_prompt_tokens)

    @property
    def token_ids(self) -> list[int]:
        if self._tokens is None:  # made only for what reads the tokens (penalties, bad words, processors)
            self._tokens = self.seq.token_ids[: self.num_tokens]
        return self._tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.seq.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_prompt_tokens : self.num_tokens]


def _processed(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain sampler's processing: ``(penalised logits, filtered scores or None if all greedy)``."""
    processed = apply_penalties(apply_logits_processors(logits, batch), batch)
    return processed, (filter_logits(processed, batch) if batch.keys is not None else None)


def sample_drafts(
    logits: torch.Tensor, views: list[SequencePrefix], eos_token_ids
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft model's proposals for ``logits [N, V]`` (one row per sequence, ``views`` its context):
    ``(tokens [N], q [N, V] or None)``. Greedy rows take the argmax of the processed logits (their
    ``q`` row is unused: a point mass); sampled rows draw from ``q = softmax(scores)`` with a noise
    of their own (not the verifier's)."""
    batch = SamplingBatch.build(views, eos_token_ids, logits.shape[-1], logits.device)
    processed, scores = _processed(logits, batch)
    tokens = torch.argmax(processed, dim=-1)  # [N]
    if scores is None:
        return tokens, None
    drawn = gumbel_argmax(scores, uniform_noise(batch.keys ^ DRAFT_SALT, batch.steps, logits.shape[-1]))
    return torch.where(batch.greedy, tokens, drawn), torch.softmax(scores, dim=-1)


def verify(
    logits: torch.Tensor, seqs: list[Sequence], draft_probs: list[torch.Tensor | None], eos_token_ids
) -> dict[Sequence, Emitted]:
    """Emitted tokens (and their log-probabilities where asked) of each verified sequence.

    ``logits [R, V]`` float32: ``d + 1`` rows per sequence of ``seqs``, in order, ``d`` its
    ``num_draft_tokens`` (its last ``d`` tokens are the proposal). ``draft_probs[j]``: ``[d, V]`` the
    draft distributions of sequence ``j``'s proposal, or ``None`` for a point mass. Each sequence
    emits its accepted proposed tokens and one more (1 to ``d + 1`` tokens); with
    ``return_logits`` the raw logits of each emitted token are appended to ``seq.logits``.
    """
    device, vocab = logits.device, logits.shape[-1]
    views, drafts, firsts = [], [], []
    for seq in seqs:
        d = seq.num_draft_tokens
        base = seq.num_tokens - d
        firsts.append(len(views))
        views += [SequencePrefix(seq, base + i) for i in range(d + 1)]
        drafts += [*seq.token_ids[base:], -1]  # the last row has no proposal: its token is the bonus
    draft_ids = torch.tensor(drafts, dtype=torch.int64).to(device)  # [R]
    batch = SamplingBatch.build(views, eos_token_ids, vocab, device)
    processed, scores = _processed(logits, batch)
    tokens = torch.argmax(processed, dim=-1)  # [R] greedy rows' choice
    if scores is not None:
        drawn = draw(processed, batch)  # [R]: what plain sampling draws at each position (its own code)
        emit, accept = drawn, drawn == draft_ids
        if any(q is not None for q in draft_probs):
            emit, accept, q_rows = _against_draft_probs(scores, batch, draft_ids, seqs, draft_probs, firsts)
            emit = torch.where(q_rows, emit, drawn)
            accept = torch.where(q_rows, accept, drawn == draft_ids)
        tokens = torch.where(batch.greedy, tokens, emit)
        accept = torch.where(batch.greedy, tokens == draft_ids, accept)
    else:
        accept = tokens == draft_ids
    chosen = torch.where(accept, draft_ids, tokens)  # [R]: each row's token if the run reaches it
    parts = [accept, tokens]
    if batch.logprob_rows is not None:
        rows = batch.logprob_rows
        parts += token_logprobs(logits[rows], chosen[rows], batch.num_logprobs)
    host = to_host(parts)
    accept, tokens = host[0].bool().tolist(), host[1].tolist()
    wanted = [r for r, view in enumerate(views) if view.params.sample_logprobs is not None]  # batch.logprob_rows
    lp_index = {r: i for i, r in enumerate(wanted)}
    out: dict[Sequence, Emitted] = {}
    for seq, first in zip(seqs, firsts):
        d = seq.num_draft_tokens
        a = next((i for i in range(d) if not accept[first + i]), d)  # proposed tokens accepted
        emitted = [*seq.token_ids[seq.num_tokens - d :][:a], tokens[first + a]]
        logprobs = None
        if seq.params.sample_logprobs is not None:
            idx = [lp_index[first + i] for i in range(a + 1)]
            lp = [t[idx] for t in host[2:]]
            logprobs = unpack_logprobs(emitted, *lp, [seq.params.sample_logprobs] * (a + 1))
        if seq.params.return_logits:
            seq.logits += list(logits[first : first + a + 1].cpu())
        out[seq] = (emitted, logprobs)
    return out


def _against_draft_probs(scores, batch, draft_ids, seqs, draft_probs, firsts):
    """Rows with a draft distribution ``q``: ``(emitted if rejected, accepted, which rows)``."""
    num_rows, vocab = scores.shape
    q = torch.zeros_like(scores)  # [R, V]
    q_rows = torch.zeros(num_rows, dtype=torch.bool, device=scores.device)
    for seq, first, probs in zip(seqs, firsts, draft_probs):
        if probs is not None:
            d = seq.num_draft_tokens
            q[first : first + d] = probs
            q_rows[first : first + d] = True
    p = torch.softmax(scores, dim=-1)  # [R, V]
    index = draft_ids.clamp(min=0)[:, None]
    p_x, q_x = p.gather(1, index)[:, 0], q.gather(1, index)[:, 0]  # [R]
    u = uniform_noise(batch.keys ^ ACCEPT_SALT, batch.steps, 1)[:, 0]  # [R]
    accept = (u * q_x <= p_x) & (q_x > 0)
    residual = (p - q).clamp(min=0)  # [R, V]
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)  # p == q: nothing left, use p
    emit = gumbel_argmax(torch.log(residual), uniform_noise(batch.keys ^ RESIDUAL_SALT, batch.steps, vocab))
    return emit, accept, q_rows
