"""Sampling for the whole batch on the logits' device, in a few batched tensor ops.

One step's rows go through: log-probabilities of the raw logits (rows that asked) -> logits
processors -> ``allowed_token_ids`` -> ``bad_words`` and ``min_tokens`` bans -> penalties -> greedy
argmax, or temperature -> ``min_p`` -> ``top_k`` -> ``top_p`` -> a draw (``top_k`` and ``top_p`` by
rejection, without a sort: :func:`nucleus_draw`). Every per-request value is
a ``[N]`` tensor (allowed and banned tokens are ``(row, token)`` index lists), so no Python loop
touches the vocabulary; the one exception is a request's own ``logits_processors``, Python callables
that run on its row alone, and only for the requests that have them.

Randomness is counter-based: the uniform variate of row ``r``, token ``v`` is a hash of the
request's 64-bit key, the number of tokens the request has generated so far, and ``v``; the draw is
the Gumbel-max trick (``argmax(logits / T - log(-log u))`` samples from ``softmax(logits / T)``);
the nucleus draw's later rounds remix the row's hash words with the round number.
A request's samples are therefore a function of its own key and position alone: they do not depend
on which other requests share the batch, on the batch order, or on preemption (a recomputed request
regenerates the same variates), and no per-request generator state has to be stored, advanced or
moved between devices. A per-request ``torch.Generator`` would give the first two properties too, but
forces one ``multinomial`` call per row; the hash keeps the step to a handful of batched kernels.
The key is ``blake2b(seed, choice index)`` for a seeded request and a draw from torch's global
generator otherwise.

The results cross to the host once per step (:func:`to_host`): the sampled ids, plus the
log-probabilities where a request asked for them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Collection
from dataclasses import dataclass

import torch

from ..device import is_gpu, is_triton_interpreter, upload
from .sampling_params import SamplingParams
from .sequence import Sequence

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # odd, < 2^31: products of 32-bit values stay below 2^63 in int64


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, its rank (1 = likeliest), and the top k."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def sample_key(seed: int | None, index: int = 0) -> int:
    """A request's 63-bit random key: a hash of ``(seed, index)``, or a draw from torch's global generator."""
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64))
    data = seed.to_bytes((seed.bit_length() + 8) // 8 + 1, "little", signed=True) + index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of an int64 tensor with values in [0, 2^32)."""
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    return x ^ (x >> 16)


@functools.cache
def _kernels():
    try:
        from ..kernels.triton import fused_launch
    except ImportError:  # no triton here: the torch code draws
        return None
    return fused_launch


def draw_kernels(logits: torch.Tensor):
    """The Triton launchers that draw on ``logits``' device (GPUs), or ``None`` where torch draws."""
    if not is_gpu(logits.device) or is_triton_interpreter():
        return None
    return _kernels()


def argmax_into(logits: torch.Tensor, out: torch.Tensor, copy_into: torch.Tensor | None = None) -> torch.Tensor:
    """``out := argmax(logits [N, V], -1)`` (int64 ``[N]``) and, with ``copy_into``, ``copy_into :=
    logits``: the decode graph's greedy ids and its copy of the logits. On GPUs two launches of the
    Triton kernels (``fused_launch.argmax_rows``, float32 logits with a contiguous last dim), where
    torch's copy and reduction took 13.5 us of a batch-1 step on an H200; torch's code elsewhere."""
    kernels = draw_kernels(logits)
    if kernels is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return kernels.argmax_rows(logits, out, copy_into=copy_into)
    if copy_into is not None:
        logits = copy_into.copy_(logits)
    return torch.argmax(logits, dim=-1, out=out)


def row_words(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[2, N]`` int64 (values below 2^32): the two hash words of each row's variates, from its key
    and step."""
    row = _mix32((keys & _M32) ^ _mix32(((keys >> 32) & _M32) ^ _mix32(steps & _M32)))  # [N]
    row2 = _mix32(row ^ 0x5BD1E995)  # [N], a second, independent word for the row
    return torch.stack([row, row2])


def round_words(words: torch.Tensor, r: int) -> torch.Tensor:
    """The row words of draw round ``r`` of the nucleus sampler (round 0: ``words`` themselves)."""
    if r == 0:
        return words
    r_mixed = _mix32(torch.tensor(r, dtype=torch.int64, device=words.device))
    return torch.stack([_mix32(words[0] ^ r_mixed), _mix32((words[1] + r) & _M32)])


def noise_of_words(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` float32 uniform variates in (0, 1) of the rows' hash words ``[2, N]`` and the token ids."""
    row, row2 = words  # [N] each
    col = _mix32(torch.arange(vocab_size, device=words.device, dtype=torch.int64))  # [V]
    h = _mix32((_mix32(row[:, None] ^ col[None, :]) + row2[:, None]) & _M32)  # [N, V]
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, never 0 or 1


def uniform_noise(keys: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` float32 uniform variates in (0, 1), a pure function of ``(keys[r], steps[r], v)``."""
    return noise_of_words(row_words(keys, steps), vocab_size)


def gumbel_argmax(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``argmax(scores - log(-log u))``: a draw from ``softmax(scores)`` per row (``[N, V]`` -> ``[N]``)."""
    return torch.argmax(scores - torch.log(-torch.log(u)), dim=-1)


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """The per-row sampling parameters of one step as device tensors (``N`` rows)."""

    params: list[SamplingParams]
    greedy: torch.Tensor | None  # [N] bool; None (with keys) when every row is greedy
    temperature: torch.Tensor | None  # [N] float32, 1 on greedy rows; None when every row is greedy
    top_k: torch.Tensor | None  # [N] int64, V for "all"; None when no row filters
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None  # [N] float32
    keys: torch.Tensor | None  # [N] int64, None when every row is greedy
    steps: torch.Tensor | None  # [N] int64 tokens generated so far
    allowed: tuple[torch.Tensor, ...] | None  # (rows [A], token ids [A], unrestricted rows [N] bool)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked to -inf (min_tokens, bad words)
    processors: list[tuple] | None  # (row, callables, prompt ids, output ids) of rows with logits processors
    penalties: tuple[torch.Tensor, ...] | None  # (presence, frequency, repetition [N], output ids, prompt ids)
    logprob_rows: torch.Tensor | None  # [R] rows that asked for log-probabilities
    num_logprobs: int  # the most top log-probabilities any row asked for

    @classmethod
    def build(
        cls, seqs: list[Sequence], eos_token_ids: set[int], vocab_size: int, device, ahead: Collection[Sequence] = ()
    ) -> SamplingBatch:
        """``ahead``: sequences with one output token in flight, not yet in their ``token_ids`` (its
        draw is their next: ``async_scheduling``)."""
        params = [s.params for s in seqs]
        generated = [s.num_output_tokens + (s in ahead) for s in seqs]

        def column(values, dtype) -> torch.Tensor:
            return upload(values, dtype, device)  # queued behind the step, which it does not wait for

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        top_k = top_p = min_p = keys = steps = greedy_rows = temperature = None
        if not all_greedy:  # an all-greedy step copies nothing for these (argmax alone)
            greedy_rows = column(greedy, torch.bool)
            temperature = column([1.0 if p.greedy else p.temperature for p in params], torch.float32)
            if any(p.top_k > 0 for p in params):
                top_k = column([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
            if any(p.top_p < 1 for p in params):
                top_p = column([p.top_p for p in params], torch.float32)
            if any(p.min_p > 0 for p in params):
                min_p = column([p.min_p for p in params], torch.float32)
            keys = column([s.sample_key for s in seqs], torch.int64)
            steps = column(generated, torch.int64)
        rows, ids = [], []
        for i, s in enumerate(seqs):
            ban = bad_word_bans(s) if s.bad_word_ids else set()
            if generated[i] < s.params.min_tokens:
                ban |= set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else eos_token_ids)
            if ban:
                ban = sorted(t for t in ban if t < vocab_size)  # a larger id cannot be sampled anyway
                rows += [i] * len(ban)
                ids += ban
        banned = (column(rows, torch.int64), column(ids, torch.int64)) if rows else None
        allowed = None
        if any(p.allowed_token_ids is not None for p in params):
            pairs = [(i, t) for i, p in enumerate(params) for t in p.allowed_token_ids or () if t < vocab_size]
            allowed = (
                column([i for i, _ in pairs], torch.int64),
                column([t for _, t in pairs], torch.int64),
                column([p.allowed_token_ids is None for p in params], torch.bool),
            )
        processors = [
            (i, s.params.processors, s.prompt_token_ids[:], s.output_token_ids)
            for i, s in enumerate(seqs)
            if s.params.logits_processors
        ]
        penalties = None
        if any(p.has_penalties for p in params):
            outputs = [s.output_token_ids for s in seqs]
            prompts = [s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
            penalties = (
                column([p.presence_penalty for p in params], torch.float32),
                column([p.frequency_penalty for p in params], torch.float32),
                column([p.repetition_penalty for p in params], torch.float32),
                column(_padded(outputs, vocab_size), torch.int64),
                column(_padded(prompts, vocab_size), torch.int64),
            )
        wanted = [i for i, p in enumerate(params) if p.sample_logprobs is not None]
        return cls(
            params=params,
            greedy=greedy_rows,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            keys=keys,
            steps=steps,
            allowed=allowed,
            banned=banned,
            processors=processors or None,
            penalties=penalties,
            logprob_rows=column(wanted, torch.int64) if wanted else None,
            num_logprobs=max((params[i].sample_logprobs for i in wanted), default=0),
        )


def bad_word_token_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The token sequences ``SamplingParams.bad_words`` forbid: each word (leading space stripped) as
    it tokenizes at the start of a text and, where that differs, after a space (in the middle of a
    text; a byte-level BPE often has one token for " word" and several for "word"). No special
    tokens are added."""
    out = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"expected bad_words that tokenize to at least one token, got {word!r}")
        out.append(plain)
        if spaced != plain:
            out.append(spaced)
    return tuple(out)


def bad_word_bans(seq: Sequence) -> set[int]:
    """The tokens ``seq``'s bad words forbid next: the last token of each bad-word token sequence
    whose other tokens end the output so far (a one-token word is always forbidden)."""
    bans = set()
    num_out = seq.num_output_tokens
    tokens = seq.token_ids
    for *prefix, last in seq.bad_word_ids:
        if len(prefix) <= num_out and tokens[len(tokens) - len(prefix) :] == prefix:
            bans.add(last)
    return bans


def _padded(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max(map(len, rows)))
    return [r + [pad] * (width - len(r)) for r in rows]


def apply_logits_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits [N, V]`` with each request's ``logits_processors`` applied to its row, in order (a copy
    when any row has them: the raw logits stay for the log-probabilities)."""
    if batch.processors is None:
        return logits
    logits = logits.clone()
    for row, fns, prompt, output in batch.processors:
        x = logits[row]  # [V]
        for fn, takes_prompt in fns:
            x = fn(prompt, output, x) if takes_prompt else fn(output, x)
            if not isinstance(x, torch.Tensor) or x.shape != logits.shape[1:]:
                got = f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"expected logits_processors to return a tensor of shape [{logits.shape[1]}], got {got}"
                )
        logits[row] = x
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Keep only ``allowed_token_ids``, ban tokens (``bad_words``, ``min_tokens``), then the presence,
    frequency and repetition penalties; ``[N, V]``."""
    if batch.allowed is not None:
        rows, ids, free = batch.allowed
        keep = free[:, None].expand(logits.shape).clone()  # [N, V]: every token of unrestricted rows
        keep[rows, ids] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.penalties is not None:
        presence, frequency, repetition, output_ids, prompt_ids = batch.penalties
        n, vocab = logits.shape
        counts = torch.zeros(n, vocab + 1, device=logits.device)  # column V absorbs the padding
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]  # [N, V] occurrences in the output
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)  # [N, V] in the prompt or the output
        rep = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits


def scale_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled ``[N, V]`` logits with tokens below ``min_p`` of the likeliest at -inf."""
    logits = logits / batch.temperature[:, None]
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled ``[N, V]`` logits with tokens outside ``min_p`` / ``top_k`` / ``top_p`` at -inf
    (``top_k`` and ``top_p`` by one sort): the distribution speculative decoding's rejection sampler
    compares. The draw keeps the same tokens without a sort, except that a tie at the ``top_p``
    boundary stays whole there (its mass above is counted by score, not by sorted position)."""
    logits = scale_min_p(logits, batch)
    if batch.top_k is None and batch.top_p is None:
        return logits
    ordered, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
    if batch.top_k is not None:
        kth = ordered.gather(1, (batch.top_k - 1).clamp(max=logits.shape[-1] - 1)[:, None])  # [N, 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # ties with the k-th value stay
    if batch.top_p is not None:
        probs = torch.softmax(ordered, dim=-1)
        # Keep the smallest head whose mass reaches top_p (the likeliest token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= batch.top_p[:, None]
        drop &= (batch.top_p < 1)[:, None]
        drop[:, 0] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


@dataclass(frozen=True, eq=False)
class SamplerOutput:
    """Device tensors of one step: ``tokens [N]``, and for ``rows [R]`` that asked for log-probabilities
    the chosen token's ``logprob [R]`` and ``rank [R]`` and the ``top_ids / top_logprobs [R, k]``."""

    tokens: torch.Tensor
    rows: torch.Tensor | None = None
    logprob: torch.Tensor | None = None
    rank: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


NUCLEUS_ROUNDS = 32  # draws of the nucleus sampler before a row takes its likeliest token


def score_keys(s: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 keys of float32 scores (``a < b`` exactly when ``key(a) < key(b)``): the
    nucleus kernel's, which compares keys where it looks for the k-th largest score."""
    bits = s.contiguous().view(torch.int32).to(torch.int64) & _M32
    return torch.where(bits >= 1 << 31, _M32 - bits, bits | (1 << 31))


def nucleus_draw(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    words: torch.Tensor,
    greedy: torch.Tensor,
    *,
    divide: bool,
    rounds: int = NUCLEUS_ROUNDS,
    top_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """``tokens [N]``: a sample of each row's nucleus (``top_p [N]``, 1 for the whole distribution) by
    rejection, the argmax on ``greedy`` rows; the torch code of ``kernels/triton/nucleus.py`` (its
    docstring has the method), drawing the same tokens. ``scores [N, V]`` float32: raw logits with
    ``divide`` (divided by ``temperature`` here), else scaled already; ``words [2, N]``: the rows'
    hash words (:func:`row_words`); ``top_k [N]`` (V or more: every token): the nucleus is taken of
    the tokens scoring at least the row's k-th largest score. Device work only (``rounds`` fixed),
    except on the CPU, which stops once every row has its token."""
    s = scores / temperature[:, None] if divide else scores
    top = s.max(dim=-1).values  # [N]
    argmax = torch.argmax(s, dim=-1)  # [N]
    safe_top = torch.where(top == float("-inf"), 0.0, top)[:, None]
    weights = torch.exp(s - safe_top)  # [N, V]
    keys = score_keys(s)  # [N, V]
    floor = torch.zeros_like(top, dtype=torch.int64)  # every key is >= 0: no top_k
    if top_k is not None:
        vocab = s.shape[-1]
        ordered = keys.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])[:, 0]
        floor = torch.where((top_k < vocab) & ~greedy, kth, floor)
    in_set = keys >= floor[:, None]  # [N, V]: the top-k set (every token without top_k)
    total = torch.where(in_set, weights, 0.0).sum(dim=-1)  # [N]
    token, done = argmax.clone(), greedy.clone()
    lo = torch.full_like(top, float("-inf"))
    for r in range(rounds):
        noisy = torch.where(
            (s > lo[:, None]) & in_set,
            s - torch.log(-torch.log(noise_of_words(round_words(words, r), s.shape[-1]))),
            float("-inf"),
        )
        best = noisy.max(dim=-1).values
        drawn = torch.where(best == float("-inf"), argmax, torch.argmax(noisy, dim=-1))
        drawn_score = s.gather(1, drawn[:, None])  # [N, 1]
        mass_above = torch.where(s > drawn_score, weights, 0.0).sum(dim=-1)
        accept = ~done & ((top_p >= 1) | (mass_above < top_p * total))
        token = torch.where(accept, drawn, token)
        lo = torch.where(done | accept, lo, drawn_score[:, 0])
        done = done | accept
        if s.device.type == "cpu" and done.numpy().all():  # no device to wait for: stop when all are drawn
            break
    return token


def draw(logits: torch.Tensor, rows) -> torch.Tensor:
    """The last part of sampling: ``tokens [N]`` int64 from processed ``logits [N, V]`` (float32).

    Greedy rows (every row when ``rows.keys`` is None) take the argmax; the others draw from the
    temperature-scaled distribution that ``min_p`` / ``top_k`` / ``top_p`` leave, with the row's
    counter-based noise: by :func:`nucleus_draw` (``top_k`` and ``top_p`` without a sort), or, when no
    row has either, by the plain Gumbel-max draw, which is what the nucleus draw gives a row of
    ``top_p`` 1 and ``top_k`` V.
    A row's token depends on its own parameters only. ``rows`` has the per-row tensors ``greedy,
    temperature, top_k, top_p, min_p, keys, steps`` (``None``: unused): a :class:`SamplingBatch`, or
    the static buffers of captured decode steps, which run this inside their graphs. Device work only,
    no host sync (the CPU's nucleus rounds stop early); a neutral value (``min_p`` 0, ``top_k`` >= V,
    ``top_p`` 1) leaves a row exactly as a ``None`` filter does. On GPUs the draws are Triton kernels
    (``kernels/triton/nucleus.py``, ``gumbel_max.py``: the same variates, computed in registers)."""
    if rows.keys is None:
        return torch.argmax(logits, dim=-1)
    kernels = draw_kernels(logits)
    words = row_words(rows.keys, rows.steps)
    divide = rows.min_p is None  # the kernels divide raw logits; min_p masks scaled ones first
    scores = logits if divide else scale_min_p(logits, rows)
    if rows.top_p is None and rows.top_k is None:  # the plain draw, in one pass
        if kernels is not None:
            return kernels.gumbel_max(scores, rows.temperature, words, rows.greedy, divide=divide)
        s = scores / rows.temperature[:, None] if divide else scores
        drawn = gumbel_argmax(s, noise_of_words(words, s.shape[-1]))
        return torch.where(rows.greedy, torch.argmax(s, dim=-1), drawn)
    top_p = rows.top_p if rows.top_p is not None else torch.ones_like(rows.temperature)
    if kernels is not None:
        return kernels.nucleus(
            scores, rows.temperature, top_p, words, rows.greedy, divide=divide, rounds=NUCLEUS_ROUNDS, top_k=rows.top_k
        )
    return nucleus_draw(scores, rows.temperature, top_p, words, rows.greedy, divide=divide, top_k=rows.top_k)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row of ``logits [N, V]`` (float32), on the logits' device, with no host sync."""
    raw = logits
    logits = apply_penalties(apply_logits_processors(logits, batch), batch)
    tokens = draw(logits, batch)
    if batch.logprob_rows is None:
        return SamplerOutput(tokens)
    rows = batch.logprob_rows
    chosen = tokens[rows]
    logprob, rank, top_ids, top_logprobs = token_logprobs(raw[rows], chosen, batch.num_logprobs)
    return SamplerOutput(tokens, rows, logprob, rank, top_ids, top_logprobs)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """``log_softmax(logits [R, V])`` at ``chosen [R]``, the chosen token's rank, and the top ``k``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    picked = logprobs.gather(1, chosen[:, None])  # [R, 1]
    rank = (logprobs > picked).sum(dim=-1) + 1  # [R]
    top = torch.topk(logprobs, k, dim=-1)  # [R, k]
    return picked[:, 0], rank, top.indices, top.values


class HostCopy:
    """Several small device tensors on their way to the host in one transfer (:func:`to_host`), started
    without waiting: on an accelerator into pinned memory behind an event, which :meth:`wait` waits
    for; on the CPU at once.

    They are packed into one float64 vector (exact for integer ids below 2^53 and for float32
    values), copied once, and split back to their shapes and dtypes on the host.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        self.shapes = [(t.shape, t.dtype) for t in tensors]
        self.event = None
        if not tensors:
            self.flat = None
            return
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        if not is_gpu(flat.device):
            self.flat = flat.cpu()
            return
        self.flat = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self.flat.copy_(flat, non_blocking=True)
        self.event = torch.Event(flat.device)
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        out, start = [], 0
        for shape, dtype in self.shapes:
            n = shape.numel()
            out.append(self.flat[start : start + n].reshape(shape).to(dtype))
            start += n
        return out


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy several small device tensors to the host in one transfer (see :class:`HostCopy`)."""
    return HostCopy(tensors).wait()


def unpack_logprobs(token_ids: list[int], logprob, rank, top_ids, top_logprobs, ks: list[int]) -> list[TokenLogprobs]:
    """Host tensors of log-probabilities (``[R]``, ``[R]``, ``[R, k]``, ``[R, k]``) -> one
    :class:`TokenLogprobs` per row, with row ``i``'s chosen token ``token_ids[i]`` and top ``ks[i]``."""
    logprob, rank, top_ids, top_logprobs = logprob.tolist(), rank.tolist(), top_ids.tolist(), top_logprobs.tolist()
    return [
        TokenLogprobs(t, logprob[i], int(rank[i]), tuple(top_ids[i][: ks[i]]), tuple(top_logprobs[i][: ks[i]]))
        for i, t in enumerate(token_ids)
    ]
