"""Prompt lookup against a plain loop that states the rule: the longest suffix of min_n .. max_n tokens
that occurred earlier, its earliest occurrence, and the up to k tokens after it; on random histories
over small vocabularies (many repeats), and the proposer's incremental histories."""

from __future__ import annotations

import random

import numpy as np
import pytest

from portattn.engine.sampling_params import SamplingParams
from portattn.engine.sequence import Sequence
from portattn.engine.spec_decode.ngram import NgramProposer, ngram_propose


def reference(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    num = len(history)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = history[num - n :]
        for start in range(num - n):  # the n-gram history[start : start + n], followed by a token
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_ngram_proposals_equal_the_plain_loop(vocab):
    rng = random.Random(vocab)
    for _ in range(400):
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        got = ngram_propose(np.array(history, dtype=np.int64), k, min_n, max_n).tolist()
        assert got == reference(history, k, min_n, max_n), (history, k, min_n, max_n)


def test_ngram_edge_cases():
    h = np.array([1, 2, 3, 1, 2], dtype=np.int64)
    assert ngram_propose(h, 4, 1, 3).tolist() == [3, 1, 2]  # the history ends after 3 tokens
    assert ngram_propose(h, 4, 3, 3).tolist() == []  # no 3-gram recurs
    assert ngram_propose(h[:1], 2, 1, 2).tolist() == []  # one token: nothing before it
    assert ngram_propose(np.array([7, 7], dtype=np.int64), 3, 1, 5).tolist() == [7]


def test_the_proposer_keeps_each_history_up_to_date():
    proposer = NgramProposer(k=3, min_n=1, max_n=2)
    a = Sequence(0, [4, 5, 6, 4], SamplingParams())
    b = Sequence(1, [9, 9], SamplingParams())
    assert proposer.propose([(a, 3), (b, 2)]) == [([5, 6, 4], None), ([9], None)]
    a.token_ids += [8] * 200 + [4, 5]  # grows past the buffer
    assert proposer.propose([(a, 2)]) == [([6, 4], None)]  # "4 5" first occurs at 0
    assert proposer.propose([(a, 3)])[0][0] == reference(a.token_ids, 3, 1, 2)
    proposer.release({0})
    assert set(proposer.histories) == {0}
