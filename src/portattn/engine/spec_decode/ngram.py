"""Prompt lookup: propose the tokens that followed an earlier occurrence of the sequence's suffix.

For a history ``h`` of ``N`` tokens (prompt and output), every earlier end position ``e`` (the
candidate n-gram is ``h[e - n : e]``, followed by ``h[e]``, so ``e <= N - 1``) is scored by how many
of the tokens before it agree with the last tokens of the history, up to ``max_n``::

    match[t, e] = h[e - 1 - t] == h[N - 1 - t]          t = 0 .. max_n - 1
    length[e]   = number of leading True in match[:, e]   (cumulative product, summed)

The longest ``length >= min_n`` wins, the earliest ``e`` among equals (it has the most tokens after
it), and the proposal is ``h[e : e + k]`` (fewer tokens when the history ends first). One ``[max_n, N]`` comparison per
sequence: no Python loop over the history. Each sequence's history is kept as a growing NumPy array,
so a step converts only the tokens that are new since the last.
"""

from __future__ import annotations

import numpy as np

from ..sequence import Sequence


def ngram_propose(history: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``k`` proposed tokens for ``history [N]`` (int64), or an empty array when no n-gram of
    ``min_n .. max_n`` tokens recurs."""
    num = history.shape[0]
    max_n = min(max_n, num - 1)
    if max_n < min_n or k < 1:
        return history[:0]
    ends = np.arange(1, num)  # [E] candidate end positions e (exclusive), E = N - 1
    offsets = np.arange(max_n)[:, None]  # [max_n, 1]
    before = ends[None, :] - 1 - offsets  # [max_n, E] index of the token t before e
    match = (before >= 0) & (history[np.maximum(before, 0)] == history[num - 1 - offsets])  # [max_n, E]
    length = np.cumprod(match, axis=0).sum(axis=0)  # [E]
    best = int(length.max())
    if best < min_n:
        return history[:0]
    end = int(ends[np.flatnonzero(length == best)[0]])  # the earliest among the longest
    return history[end : end + k]


class NgramProposer:
    """Prompt-lookup proposals (:func:`ngram_propose`) for the engine's running sequences."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.histories: dict[int, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[tuple[list[int], None]]:
        """``(proposed tokens, None)`` (a point-mass proposal) for each ``(sequence, most tokens)``;
        a sequence's history is its ``token_ids``."""
        return [(ngram_propose(self._history(seq), k, self.min_n, self.max_n).tolist(), None) for seq, k in requests]

    def _history(self, seq: Sequence) -> np.ndarray:
        tokens = seq.token_ids
        buffer, size = self.histories.get(seq.request_id, (None, 0))
        if buffer is None or size > len(tokens):
            buffer, size = np.empty(max(64, 2 * len(tokens)), np.int64), 0
        if len(tokens) > buffer.shape[0]:
            grown = np.empty(2 * len(tokens), np.int64)
            grown[:size] = buffer[:size]
            buffer = grown
        buffer[size : len(tokens)] = tokens[size:]  # a sequence only grows between proposals
        self.histories[seq.request_id] = (buffer, len(tokens))
        return buffer[: len(tokens)]

    def release(self, live: set[int]) -> None:
        """Forget the histories of requests not in ``live``."""
        for request_id in [r for r in self.histories if r not in live]:
            del self.histories[request_id]
