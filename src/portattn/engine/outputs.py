"""What a request returns, shaped like vLLM's outputs, and the bookkeeping that builds them
(whole, or as the deltas a stream sends)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampler import TokenLogprobs
from .sequence import Sequence


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability, its rank among the vocabulary (1 = likeliest) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: {token id: Logprob}, the chosen token first, then the top k (likeliest first).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` choices.

    ``token_ids`` are the generated tokens (a stop or end-of-sequence token included); ``text`` their
    text, cut at a stop string. ``logprobs`` has one entry per token of ``token_ids`` when asked for
    (``SamplingParams(logprobs=k)``), with ``cumulative_logprob`` their sum (also set, without
    ``logprobs``, when ``best_of`` ranked the choices by it). ``finish_reason`` is
    ``"stop"``, ``"length"`` or ``"abort"`` (None while it runs); ``stop_reason`` the stop string or
    stop token id that ended it. In a stream's delta outputs, ``text``, ``token_ids`` and ``logprobs``
    hold only what is new since the previous delta.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logits: torch.Tensor | None = None  # [len(token_ids), V] float32, with SamplingParams(return_logits=True)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request: its prompt and its choices (``outputs[i]`` is choice ``i``).

    ``prompt_logprobs`` (with ``SamplingParams(prompt_logprobs=k)``) has ``None`` for the first prompt
    token and a :data:`PositionLogprobs` for each later one. ``token_ids``, ``text``, ``finish_reason``
    and ``logits`` are those of the first choice, for the common ``n = 1`` case.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logits: torch.Tensor | None = None  # [len(prompt), V], with return_prompt_logits=True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logits(self) -> torch.Tensor | None:
        return self.outputs[0].logits


class RequestState:
    """A request's sequences (one per choice) and how much of each has been reported.

    :meth:`output` builds the whole :class:`RequestOutput` (``delta=False``) or what is new since the
    last delta (``delta=True``; ``None`` when nothing is). A delta's text stops short of a stop
    string that may still be forming (:meth:`IncrementalDetokenizer.streamable`). With ``best_of``
    above ``n``, the whole output holds the ``n`` likeliest of the ``best_of`` sequences (deltas, which
    only a server that does not stream reads, hold every sequence).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        seqs: list[Sequence],
        token_text: Callable[[int], str] | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.seqs = seqs
        self.token_text = token_text
        self.sent_tokens = [0] * len(seqs)
        self.sent_chars = [0] * len(seqs)
        self.sent_finish = [False] * len(seqs)
        self.sent_prompt = False

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    @property
    def num_output_tokens(self) -> int:
        return sum(seq.num_output_tokens for seq in self.seqs)

    def output(self, delta: bool = False) -> RequestOutput | None:
        outputs = []
        for i, seq in enumerate(self.seqs):
            done = seq.finish_reason is not None
            num_tokens = seq.num_output_tokens
            text = seq.detokenizer.text if seq.detokenizer is not None else ""
            chars = seq.detokenizer.streamable(done) if seq.detokenizer is not None else 0
            first_token, first_char = (self.sent_tokens[i], self.sent_chars[i]) if delta else (0, 0)
            if delta:
                if num_tokens == first_token and chars == first_char and (self.sent_finish[i] or not done):
                    continue
                self.sent_tokens[i], self.sent_chars[i], self.sent_finish[i] = num_tokens, chars, done
            tokens = seq.token_ids[seq.num_prompt_tokens + first_token :]  # only what this output sends
            logprobs = None
            cumulative = None
            if seq.params.sample_logprobs is not None:  # asked for, or best_of ranks by them
                cumulative = sum(t.logprob for t in seq.logprobs)
            if seq.params.logprobs is not None:
                logprobs = [self._position(t) for t in seq.logprobs[first_token:]]
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text[first_char:chars] if delta else text,
                    token_ids=tokens,
                    cumulative_logprob=cumulative,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logits=torch.stack(seq.logits[first_token:]) if len(seq.logits) > first_token else None,
                )
            )
        first = self.seqs[0]
        if not delta and first.params.num_seqs > first.params.n:
            outputs = self._best(outputs, first.params.n)
        send_prompt = not (delta and self.sent_prompt)
        if delta:
            if not outputs:
                return None
            self.sent_prompt = True
        prompt_logprobs = None
        if send_prompt and first.params.prompt_logprobs is not None:
            # The choices prefill apart (a later one may start first): any whose prefill is done has them.
            done = (s for s in self.seqs if len(s.prompt_logprobs) == s.num_prompt_tokens - 1)
            prompt_logprobs = [None, *(self._position(t) for t in next(done, first).prompt_logprobs)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
            prompt_logits=torch.cat(first.prompt_logits) if send_prompt and first.prompt_logits else None,
        )

    @staticmethod
    def _best(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
        """``best_of``: the ``n`` outputs of highest cumulative log-probability (the earlier choice
        first on a tie), numbered 0 .. n - 1 in that order."""
        ranked = sorted(outputs, key=lambda c: -c.cumulative_logprob)[:n]
        for i, c in enumerate(ranked):
            c.index = i
        return ranked

    def _position(self, t: TokenLogprobs) -> PositionLogprobs:
        text = self.token_text or (lambda _: None)
        entry = {t.token_id: Logprob(t.logprob, t.rank, text(t.token_id))}
        for rank, (token, logprob) in enumerate(zip(t.top_ids, t.top_logprobs), start=1):
            entry[token] = Logprob(logprob, rank, text(token))
        return entry
