"""Per-request sampling parameters, with the names and meanings vLLM's users know."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..errors import expect
from .arguments import doc

MAX_LOGPROBS = 20  # most top log-probabilities returned per position (OpenAI's limit too)
# Below this, logits / temperature can overflow float32 (1e-38 turns every logit into inf and the
# softmax into NaN); the distribution is one-hot long before it. Refused, not rounded to greedy.
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # seeds are 64-bit values, as in torch.Generator and the OpenAI API
# The fields whose default a checkpoint's generation_config.json may set (as vLLM reads it).
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class _UnsetFloat(float):
    """The default of a field in GENERATION_CONFIG_FIELDS: equal to vLLM's default, and of a type of
    its own so that ``__post_init__`` can tell that the caller did not pass the field."""


class _UnsetInt(int):
    """As :class:`_UnsetFloat`, for ``top_k``."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Choices: ``n`` completions per prompt, each sampled independently (with ``seed``, choice ``i``
    draws from the stream of ``(seed, i)``, so the set is reproducible). With ``best_of`` (at least
    ``n``), ``best_of`` sequences are generated and the ``n`` with the highest ``cumulative_logprob``
    are returned, likeliest first (the request cannot be streamed).

    Defaults: those of vLLM (``temperature`` 1, so ``SamplingParams()`` samples; ``temperature=0`` is
    greedy). ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left unset
    take the values of the checkpoint's ``generation_config.json`` when the engine has them (engine
    option ``generation_config``; ``"vllm"`` ignores the file); :attr:`unset` names them.

    Sampling, applied to the model's float32 logits in this order: ``logits_processors`` (callables
    ``(output_token_ids, logits) -> logits`` or ``(prompt_token_ids, output_token_ids, logits) ->
    logits`` on the request's ``[V]`` row, run in order), ``allowed_token_ids`` (every other token
    is impossible), ``bad_words`` (each word, tokenized as it would start the text and after a space,
    is a token sequence whose last token is impossible when the output ends with the others),
    ``min_tokens`` (end-of-sequence and ``stop_token_ids`` are impossible until that many tokens are
    out), the penalties (``repetition_penalty`` divides positive / multiplies negative logits of
    tokens seen in the prompt or output; ``frequency_penalty`` subtracts ``count`` times itself for
    each output token, ``presence_penalty`` subtracts itself once), then ``temperature`` (0 is greedy:
    argmax of the penalised logits, and the parameters below are unused; a positive temperature is at
    least ``MIN_TEMPERATURE``, 1e-5: smaller ones are refused, not taken as greedy), ``min_p`` (drop
    tokens less likely than ``min_p`` times the likeliest), ``top_k`` (-1 keeps every token) and
    ``top_p`` (the smallest set of likeliest tokens whose mass reaches ``top_p``; 1 keeps every
    token). ``seed`` (an int in ``[0, 2**64)``) makes the samples a function of the seed alone,
    whatever else is in the batch; without it they come from torch's global generator, drawn when
    the request is added.

    Prompt: ``truncate_prompt_tokens = k`` keeps the last ``k`` prompt tokens (-1: the last
    ``max_model_len - 1``, the most that leaves room for one new token).

    Stopping: after ``max_tokens`` tokens ("length"; ``None``: when prompt and output fill
    ``max_model_len``); at an end-of-sequence token unless ``ignore_eos``, or at a token of
    ``stop_token_ids`` ("stop"; the token stays in ``token_ids``, its text is left out of ``text``);
    or when the decoded text contains a string of ``stop`` ("stop"; matched across token boundaries,
    the text cut before it unless ``include_stop_str_in_output``; checked once more than
    ``min_tokens`` tokens are out).

    Outputs: ``logprobs = k`` returns, per output token, the log-probabilities (log-softmax of the
    model's logits, before penalties and temperature) of the sampled token and of the ``k`` likeliest;
    ``prompt_logprobs = k`` the same for each prompt token after the first (and makes the request
    skip the prefix cache). ``skip_special_tokens`` leaves special tokens out of ``text``.
    ``return_logits`` keeps the logits each output token was sampled from
    (``[num_output_tokens, vocab]``); ``return_prompt_logits`` keeps the logits at every prompt
    position (``[num_prompt_tokens, vocab]``) and makes the request skip the prefix cache.

    ``stop`` may be given as a str or a list; it is stored as a tuple, as are ``stop_token_ids``,
    ``allowed_token_ids``, ``bad_words`` and ``logits_processors``.
    """

    n: int = field(default=1, metadata=doc("completions per prompt"))
    best_of: int | None = field(
        default=None, metadata=doc("sequences generated per prompt, the n likeliest returned (default: n)")
    )
    max_tokens: int | None = field(
        default=16, metadata=doc("most tokens generated per completion; None: up to max_model_len")
    )
    min_tokens: int = field(default=0, metadata=doc("tokens generated before any stop condition applies"))
    temperature: float = field(
        default=_UnsetFloat(1.0),
        metadata=doc("softmax temperature; 0 is greedy, else at least 1e-5 (unset: generation_config.json's)"),
    )
    top_p: float = field(
        default=_UnsetFloat(1.0),
        metadata=doc("nucleus sampling: the smallest set of tokens with this much probability"),
    )
    top_k: int = field(default=_UnsetInt(-1), metadata=doc("sample among the k likeliest tokens; -1 keeps all"))
    min_p: float = field(
        default=_UnsetFloat(0.0), metadata=doc("drop tokens less likely than min_p times the likeliest")
    )
    presence_penalty: float = field(default=0.0, metadata=doc("subtracted once from the logit of each output token"))
    frequency_penalty: float = field(
        default=0.0, metadata=doc("subtracted from a token's logit per time it is in the output")
    )
    repetition_penalty: float = field(
        default=_UnsetFloat(1.0),
        metadata=doc("divides positive / multiplies negative logits of prompt and output tokens"),
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
    truncate_prompt_tokens: int | None = field(
        default=None, metadata=doc("keep the prompt's last k tokens (-1: as many as max_model_len leaves room for)")
    )
    allowed_token_ids: tuple[int, ...] | None = field(default=None, metadata=doc("sample only among these tokens"))
    bad_words: tuple[str, ...] = field(default=(), metadata=doc("words whose last token is never sampled to end them"))
    logits_processors: tuple[Callable, ...] = field(
        default=(), metadata=doc("callables (output_token_ids, logits) -> logits run on the request's logits")
    )

    def __post_init__(self) -> None:
        unset = []
        for name in GENERATION_CONFIG_FIELDS:
            value = getattr(self, name)
            if type(value) in (_UnsetFloat, _UnsetInt):
                unset.append(name)
                object.__setattr__(self, name, float(value) if isinstance(value, float) else int(value))
        object.__setattr__(self, "_unset", frozenset(unset))
        _int(self.n, "n", low=1)
        if self.best_of is not None:
            _int(self.best_of, "best_of", low=self.n)
        _int(self.min_tokens, "min_tokens", low=0)
        if self.max_tokens is not None:  # None: up to max_model_len
            _int(self.max_tokens, "max_tokens", low=1)
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
        self._check_constraints()

    def _check_constraints(self) -> None:
        """truncate_prompt_tokens, allowed_token_ids, bad_words and logits_processors."""
        k = self.truncate_prompt_tokens
        if k is not None:
            expect(_is_int(k) and (k == -1 or k >= 1), "truncate_prompt_tokens to be None, -1 or an int >= 1", repr(k))
        allowed = self.allowed_token_ids
        if allowed is not None:
            expect(
                isinstance(allowed, (list, tuple)) and allowed and all(_is_int(t) and t >= 0 for t in allowed),
                "allowed_token_ids to be None or a non-empty list of non-negative ints",
                repr(allowed),
            )
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        words = self.bad_words
        expect(
            isinstance(words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in words),
            "bad_words to be a list of non-blank strs",
            repr(words),
        )
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(words)))
        fns = self.logits_processors
        expect(
            isinstance(fns, (list, tuple)) and all(callable(fn) for fn in fns),
            "logits_processors to be a list of callables (output_token_ids, logits) -> logits",
            repr(fns),
        )
        object.__setattr__(self, "logits_processors", tuple(fns))
        object.__setattr__(self, "_processor_takes_prompt", tuple(_takes_prompt(fn) for fn in fns))

    @property
    def unset(self) -> frozenset[str]:
        """The fields of :data:`GENERATION_CONFIG_FIELDS` the caller did not pass (they hold vLLM's
        defaults until :meth:`with_defaults` replaces them)."""
        return self._unset

    def with_defaults(self, defaults: Mapping[str, object]) -> SamplingParams:
        """These parameters with each :attr:`unset` field that ``defaults`` names set to its value
        (the engine passes the checkpoint's generation config); ``self`` when none applies."""
        changes = {name: value for name, value in defaults.items() if name in self._unset}
        if not changes:
            return self
        out = dataclasses.replace(self, **changes)
        object.__setattr__(out, "_unset", self._unset - changes.keys())
        return out

    @property
    def processors(self) -> tuple[tuple[Callable, bool], ...]:
        """Each of ``logits_processors`` and whether it takes the prompt ids first (three parameters)."""
        return tuple(zip(self.logits_processors, self._processor_takes_prompt))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_seqs(self) -> int:
        """Sequences generated for each prompt: ``best_of``, or ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def sample_logprobs(self) -> int | None:
        """Top log-probabilities the sampler computes per output token: ``logprobs``, or 0 (the sampled
        token's alone) when ``best_of`` ranks the sequences by their cumulative log-probability."""
        if self.logprobs is None and self.num_seqs > self.n:
            return 0
        return self.logprobs

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @functools.cached_property
    def draws_only(self) -> bool:
        """Whether a token is the draw's alone (greedy, or temperature with ``min_p`` / ``top_k`` /
        ``top_p``): no log-probabilities, logits kept, penalties, processors or allowed tokens (bad
        words and ``min_tokens`` belong to the sequence's state). Read every decode step: computed once."""
        return (
            self.sample_logprobs is None
            and not self.return_logits
            and not self.has_penalties
            and not self.logits_processors
            and self.allowed_token_ids is None
        )

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether the prompt's positions need logits (such a request skips the prefix cache)."""
        return self.return_prompt_logits or self.prompt_logprobs is not None

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt ``truncate_prompt_tokens`` keeps: its last k tokens (all of a shorter prompt)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = max_model_len - 1 if k == -1 else k
        return list(token_ids[-k:]) if len(token_ids) > k else token_ids


def _takes_prompt(fn: Callable) -> bool:
    """Whether a logits processor takes ``(prompt_token_ids, output_token_ids, logits)`` (three
    parameters) rather than ``(output_token_ids, logits)``."""
    try:
        return len(inspect.signature(fn).parameters) == 3
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False


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
