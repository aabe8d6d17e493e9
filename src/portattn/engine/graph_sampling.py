"""Sampling inside captured decode steps: which steps may, and the per-row parameters they read.

A captured decode step (``uniform_q_len`` 1, ``graphs.py``) ends with the LM head: the logits of its
rows go to a static buffer ``[B_max, V]`` float32 and their argmax to the static token ids
``[B_max]``. A step in which every sequence samples its next token and asks for nothing but the draw
(:func:`samples_in_graph`) needs no more than that: a greedy step copies the ids to the host; a step
with sampled rows first replays a small second graph that runs :func:`~portattn.engine.sampler.draw`
over the static logits, with each row's parameters read from the static inputs
(:data:`DRAW_ROWS`, written with the step's other inputs in one copy). There is one such graph per
batch size and :class:`Filters` (which of ``min_p``, ``top_k`` and ``top_p`` run),
captured the first time a step needs it. Rows without a filter carry its neutral value (``min_p`` 0,
``top_k`` all, ``top_p`` 1), which leaves them exactly as the eager sampler leaves them, so the tokens
are the eager path's for the same logits, seeds and positions.

Every other step (log-probabilities, penalties, logits processors, ``allowed_token_ids``, bad words,
a ``min_tokens`` ban, ``return_logits``, prompt logits, verification of proposed tokens, a prompt
chunk that does not finish its prompt) takes the logits of its rows from the static buffer and
samples them as an eager step does (``ModelRunner.sample_from``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sequence import Sequence

# The draw's per-row parameters in the static inputs, one int64 row each; the last three hold float32
# values in the first half of their row's bytes.
DRAW_ROWS = ("keys", "steps", "top_k", "greedy", "temperature", "top_p", "min_p")
KEYS, STEPS, TOP_K, GREEDY, TEMPERATURE, TOP_P, MIN_P = range(len(DRAW_ROWS))
TOP_K_ALL = 1 << 62  # top_k of a row that keeps every token: any value >= V does


def samples_in_graph(seq: Sequence, ahead: int = 0) -> bool:
    """Whether ``seq``'s next token comes from the draw alone (greedy, or temperature with ``min_p`` /
    ``top_k`` / ``top_p``): no log-probabilities, logits kept, penalties, processors, allowed or banned
    tokens (bad words, or ``min_tokens`` not yet reached). ``ahead``: output tokens sampled beyond its
    ``token_ids`` (``async_scheduling``)."""
    p = seq.params
    return p.draws_only and not seq.bad_word_ids and seq.num_output_tokens + ahead >= p.min_tokens


@dataclass(frozen=True)
class Filters:
    """Which filters a step's draw runs (the rows that do not use one carry its neutral value)."""

    min_p: bool
    top_k: bool  # some row has top_k (the nucleus draw looks for the k-th largest score)
    top_p: bool  # some row has top_p (the nucleus draw)


@dataclass(frozen=True, eq=False)
class DrawRows:
    """Device views of the draw's parameters for ``B`` rows, as :func:`~portattn.engine.sampler.draw`
    reads them (``None``: the filter does not run)."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float32, 1 on greedy rows
    top_k: torch.Tensor | None  # [B] int64
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    keys: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64 tokens generated so far


def _floats(row: torch.Tensor, batch_size: int) -> torch.Tensor:
    return row.view(torch.float32)[:batch_size]


# Padding rows (and the defaults of rows that do not filter): greedy, temperature 1, every token kept.
_PAD_INTS = np.array([0, 0, TOP_K_ALL, 1], np.int64)[:, None]  # KEYS, STEPS, TOP_K, GREEDY
_PAD_FLOATS = np.array([1.0, 1.0, 0.0], np.float32)[:, None]  # TEMPERATURE, TOP_P, MIN_P


def write_draw_rows(host: np.ndarray, seqs: list[Sequence], batch_size: int, ahead: int = 0) -> Filters | None:
    """Write the draw's parameters of ``seqs`` (rows ``0 .. n-1``) and of padding rows (greedy,
    neutral) up to ``batch_size`` into ``host [len(DRAW_ROWS), B_max]``; returns the step's
    :class:`Filters`, or ``None`` (nothing written) when every row is greedy: the argmax is the token.
    ``ahead``: output tokens each sequence has beyond its ``token_ids`` (sampled by a step whose ids the
    host has not read yet: ``async_scheduling``), which count in the draw's step number."""
    params = [seq.params for seq in seqs]
    if all(p.temperature == 0 for p in params):
        return None
    n = len(params)
    values = np.array([(p.temperature, p.top_k, p.top_p, p.min_p) for p in params], np.float64).T  # [4, n]
    greedy = values[0] == 0
    ints = host[:TEMPERATURE]  # [4, B_max]
    ints[KEYS, :n] = np.fromiter((seq.sample_key for seq in seqs), np.int64, n)
    ints[STEPS, :n] = np.fromiter((seq.num_output_tokens + ahead for seq in seqs), np.int64, n)
    ints[TOP_K, :n] = np.where(values[1] > 0, values[1], TOP_K_ALL)
    ints[GREEDY, :n] = greedy
    ints[:, n:batch_size] = _PAD_INTS
    floats = host[TEMPERATURE:].view(np.float32)  # [3, 2 * B_max]: float32 in the first half of each row
    floats[0, :n] = np.where(greedy, 1.0, values[0])
    floats[1:, :n] = values[2:]
    floats[:, n:batch_size] = _PAD_FLOATS
    sampled = values[:, ~greedy]
    return Filters(
        min_p=bool((sampled[3] > 0).any()), top_k=bool((sampled[1] > 0).any()), top_p=bool((sampled[2] < 1).any())
    )


def draw_rows(rows: torch.Tensor, batch_size: int, filters: Filters) -> DrawRows:
    """The :class:`DrawRows` of the first ``batch_size`` rows of ``rows [len(DRAW_ROWS), B_max]`` (the
    device twin of what :func:`write_draw_rows` wrote)."""
    return DrawRows(
        greedy=rows[GREEDY, :batch_size] != 0,
        temperature=_floats(rows[TEMPERATURE], batch_size),
        top_k=rows[TOP_K, :batch_size] if filters.top_k else None,
        top_p=_floats(rows[TOP_P], batch_size) if filters.top_p or filters.top_k else None,
        min_p=_floats(rows[MIN_P], batch_size) if filters.min_p else None,
        keys=rows[KEYS, :batch_size],
        steps=rows[STEPS, :batch_size],
    )
