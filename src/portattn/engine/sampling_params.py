"""Per-request sampling parameters, with the names and meanings vLLM's users know."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import expect
from .arguments import doc

MAX_LOGPROBS = 20  # most top log-probabilities returned per position (OpenAI's limit too)
# Below this, logits / temperature can overflow float32 (1e-38 turns every logit into inf and the
# softmax into NaN); the distribution is one-hot long before it. Refused, not rounded to greedy.
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # seeds are 64-bit values, as in torch.Generator and the OpenAI API


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Choices: ``n`` completions per prompt, each sampled independently (with ``seed``, choice ``i``
    draws from the stream of ``(seed, i)``, so the set is reproducible).

    Sampling, applied to the model's float32 logits in this order: ``min_tokens`` (end-of-sequence
    and ``stop_token_ids`` are impossible until that many tokens are out), the penalties
    (``repetition_penalty`` divides positive / multiplies negative logits of tokens seen in the prompt
    or output; ``frequency_penalty`` subtracts ``count`` times itself for each output token,
    ``presence_penalty`` subtracts itself once), then ``temperature`` (0 is greedy: argmax of the
    penalised logits, and the parameters below are unused; a positive temperature is at least
    ``MIN_TEMPERATURE``, 1e-5: smaller ones are refused, not taken as greedy), ``min_p`` (drop tokens less likely than
    ``min_p`` times the likeliest), ``top_k`` (-1 keeps every token) and ``top_p`` (the smallest set of
    likeliest tokens whose mass reaches ``top_p``; 1 keeps every token). ``seed`` (an int in
    ``[0, 2**64)``) makes the samples a function of the seed alone, whatever else is in the batch;
    without it they come from torch's global generator, drawn when the request is added.

    Stopping: after ``max_tokens`` tokens ("length"); at an end-of-sequence token unless
    ``ignore_eos``, or at a token of ``stop_token_ids`` ("stop"; the token stays in ``token_ids``,
    its text is left out of ``text``); or when the decoded text contains a string of ``stop``
    ("stop"; matched across token boundaries, the text cut before it unless
    ``include_stop_str_in_output``; checked once more than ``min_tokens`` tokens are out).

    Outputs: ``logprobs = k`` returns, per output token, the log-probabilities (log-softmax of the
    model's logits, before penalties and temperature) of the sampled token and of the ``k`` likeliest;
    ``prompt_logprobs = k`` the same for each prompt token after the first (and makes the request
    skip the prefix cache). ``skip_special_tokens`` leaves special tokens out of ``text``.
    ``return_logits`` keeps the logits each output token was sampled from
    (``[num_output_tokens, vocab]``); ``return_prompt_logits`` keeps the logits at every prompt
    position (``[num_prompt_tokens, vocab]``) and makes the request skip the prefix cache.

    ``stop`` may be given as a str or a list; it is stored as a tuple, as is ``stop_token_ids``.
    """

    n: int = field(default=1, metadata=doc("completions per prompt"))
    max_tokens: int = field(default=16, metadata=doc("most tokens generated per completion"))
    min_tokens: int = field(default=0, metadata=doc("tokens generated before any stop condition applies"))
    temperature: float = field(default=0.0, metadata=doc("softmax temperature; 0 is greedy, else at least 1e-5"))
    top_p: float = field(
        default=1.0, metadata=doc("nucleus sampling: the smallest set of tokens with this much probability")
    )
    top_k: int = field(default=-1, metadata=doc("sample among the k likeliest tokens; -1 keeps all"))
    min_p: float = field(default=0.0, metadata=doc("drop tokens less likely than min_p times the likeliest"))
    presence_penalty: float = field(default=0.0, metadata=doc("subtracted once from the logit of each output token"))
    frequency_penalty: float = field(
        default=0.0, metadata=doc("subtracted from a token's logit per time it is in the output")
    )
    repetition_penalty: float = field(
        default=1.0, metadata=doc("divides positive / multiplies negative logits of prompt and output tokens")
    )
    seed: int | None = field(
        default=None, metadata=doc("the request's random stream (default: drawn from torch's global generator)")
    )
    stop: str | tuple[str, ...] = field(default=(), metadata=doc("stop at this text (not returned)"))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=doc("stop at these token ids"))
    include_stop_str_in_output: bool = field(default=False, metadata=doc("keep the stop string in the text"))
    ignore_eos: bool = field(default=False, metadata=doc("keep generating past an end-of-sequence token"))
    logprobs: int | None = field(
        default=None, metadata=doc(f"log-probabilities of each output token and of the top k (k <= {MAX_LOGPROBS})")
    )
    prompt_logprobs: int | None = field(
        default=None, metadata=doc("log-probabilities of each prompt token and of the top k (skips the prefix cache)")
    )
    skip_special_tokens: bool = field(default=True, metadata=doc("leave special tokens out of the text"))
    return_logits: bool = field(default=False, metadata=doc("keep the logits each output token was sampled from"))
    return_prompt_logits: bool = field(
        default=False, metadata=doc("keep the logits at every prompt position (skips the prefix cache)")
    )

    def __post_init__(self) -> None:
        _int(self.n, "n", low=1)
        _int(self.max_tokens, "max_tokens", low=1)
        _int(self.min_tokens, "min_tokens", low=0)
        expect(self.min_tokens <= self.max_tokens, f"min_tokens <= max_tokens {self.max_tokens}", self.min_tokens)
        _float(self.temperature, "temperature")
        t = self.temperature
        expect(t == 0 or t >= MIN_TEMPERATURE, f"temperature 0 (greedy) or a finite number >= {MIN_TEMPERATURE}", t)
        _float(self.top_p, "top_p")
        expect(0 < self.top_p <= 1, "top_p in (0, 1]", self.top_p)
        _int(self.top_k, "top_k", low=-1)
        expect(self.top_k != 0, "top_k to be -1 or a positive int", self.top_k)
        _float(self.min_p, "min_p")
        expect(0 <= self.min_p <= 1, "min_p in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _float(value, name)
            expect(-2 <= value <= 2, f"{name} in [-2, 2]", value)
        _float(self.repetition_penalty, "repetition_penalty")
        expect(self.repetition_penalty > 0, "repetition_penalty > 0", self.repetition_penalty)
        if self.seed is not None:
            ok = _is_int(self.seed) and 0 <= self.seed < SEED_LIMIT
            expect(ok, "seed to be None or an int in [0, 2**64)", repr(self.seed))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        expect(
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop),
            "stop to be a non-empty str or a list of them",
            self.stop,
        )
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        expect(
            isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids),
            "stop_token_ids to be a list of non-negative ints",
            ids,
        )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(getattr(self, name), name, low=0, high=MAX_LOGPROBS)
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "return_logits",
            "return_prompt_logits",
        ):
            expect(isinstance(getattr(self, name), bool), f"{name} to be a bool", repr(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether the prompt's positions need logits (such a request skips the prefix cache)."""
        return self.return_prompt_logits or self.prompt_logprobs is not None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: object, name: str, low: int | None = None, high: int | None = None) -> None:
    what = f"{name} to be an int"
    if low is not None:
        what += f" >= {low}" if high is None else f" in [{low}, {high}]"
    ok = _is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    expect(ok, what, repr(value))


def _float(value: object, name: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    expect(ok, f"{name} to be a finite number", repr(value))
