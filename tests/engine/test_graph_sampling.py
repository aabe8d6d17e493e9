"""Sampling inside captured decode steps (the LM head, the argmax and the draw recorded with the
step), run through the same static buffers eagerly on the CPU: tokens equal the plain eager engine's
for greedy and seeded requests with every filter and mixtures of them, at batch sizes between
buckets, with the scratch page and the static logits, ids and inputs poisoned before every step and
no host sync in what a graph records; the steps that must fall back (log-probabilities, penalties,
...) do, and still equal the eager engine's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from portattn.engine.graph_sampling import (
    DRAW_ROWS,
    TOP_K_ALL,
    Filters,
    draw_rows,
    samples_in_graph,
    write_draw_rows,
)
from portattn.engine.graphs import DRAW
from portattn.engine.llm import LLM
from portattn.engine.sampler import SamplingBatch, draw
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.sequence import Sequence
from portattn.testing import no_host_sync
from tiny_models import checkpoint, random_prompts

BUCKETS = (1, 2, 4)  # 3 sequences pad to 4; 5 or 6 run eagerly
PROMPTS = random_prompts([1, 5, 15, 17, 30, 37], seed=11)
MAX_TOKENS = [24, 5, 9, 13, 30, 18]  # batches shrink through 6, 5, ..., 1
# Greedy, plain temperature, and each filter alone and together: as sequences finish, the draw runs
# with every combination of filters, and on rows that carry a filter's neutral value.
MIXED = [
    dict(temperature=0),
    dict(temperature=0.8, seed=1),
    dict(temperature=1.0, top_k=5, seed=2),
    dict(temperature=0.7, top_p=0.8, seed=3),
    dict(temperature=1.3, min_p=0.1, seed=4),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, seed=5),
]
KWARGS = dict(page_size=4, num_pages=300, max_model_len=256, max_num_seqs=8)


def params(kinds: list[dict]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True, **k) for n, k in zip(MAX_TOKENS, kinds)]


def static_llm(path: str) -> LLM:
    llm = LLM(path, enforce_eager=True, **KWARGS)
    llm.engine.runner.enable_graphs(BUCKETS, capture=False).capture_all()
    return llm


def tokens(llm: LLM, sampling: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]


def guard_and_poison(llm: LLM) -> dict:
    """Before every replayed step: NaN in the scratch page (what padding rows read), the static logits
    and inputs; -1 in the static ids. What a graph records runs under no_host_sync. Counts the draws."""
    engine = llm.engine
    graphs = engine.runner.graphs
    counts = {"draws": 0}
    forward, run_draw, run_model = graphs._forward, graphs._draw, graphs._run_model
    for cache in [*getattr(engine.kv_pool, "k", []), *getattr(engine.kv_pool, "v", [])]:
        cache[engine.runner.scratch_page].fill_(float("nan"))

    def poisoned_run(shape, num_seqs):
        if graphs.logits is not None:
            graphs.logits.fill_(float("nan"))
        graphs.tokens.fill_(-1)
        return run_model(shape, num_seqs)

    def guarded_forward(shape):
        with no_host_sync():
            return forward(shape)

    def guarded_draw(batch_size, filters):
        counts["draws"] += 1
        with no_host_sync():
            return run_draw(batch_size, filters)

    graphs._run_model, graphs._forward, graphs._draw = poisoned_run, guarded_forward, guarded_draw
    return counts


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gemma2"])  # MHA; MLA; a logit softcap
@pytest.mark.parametrize("kinds", [[MIXED[0]] * 6, MIXED], ids=["greedy", "mixed"])
def test_decode_samples_in_the_graph_as_the_eager_engine(family, kinds, ckpt_root):
    path = checkpoint(family, ckpt_root)
    want = tokens(LLM(path, enforce_eager=True, **KWARGS), params(kinds))
    llm = static_llm(path)
    counts = guard_and_poison(llm)
    assert tokens(llm, params(kinds)) == want
    graphs = llm.engine.runner.graphs
    # Steps 10 to 30 (after the prefill and the requests of 5 and 9 tokens) have 4 or fewer decodes,
    # and every one of them samples in the graph; 3 decodes ran padded to 4.
    assert graphs.replays == graphs.sampled == 21
    assert set(graphs.padded) == {3}
    assert counts["draws"] == (0 if kinds[0] == kinds[-1] else 21)


FALLBACKS = {
    "logprobs": dict(logprobs=2),
    "penalty": dict(presence_penalty=0.5, repetition_penalty=1.1),
    "min_tokens": dict(min_tokens=20),
    "allowed": dict(allowed_token_ids=list(range(40))),
    "logits": dict(return_logits=True),
    "processor": dict(logits_processors=[lambda out, x: x - 0.01 * len(out)]),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_requests_that_need_more_than_the_draw_fall_back(name, ckpt_root):
    """A step with such a request samples eagerly from the step's logits (the graph's); steps without
    it sample in the graph again. Tokens (and log-probabilities) equal the eager engine's."""
    path = checkpoint("llama", ckpt_root)
    kinds = [dict(MIXED[4], **FALLBACKS[name]), *MIXED[1:4], MIXED[0], MIXED[5]]  # the 30-token request
    eager = LLM(path, enforce_eager=True, **KWARGS).generate(PROMPTS, params(kinds), use_tqdm=False)
    llm = static_llm(path)
    guard_and_poison(llm)
    got = llm.generate(PROMPTS, params(kinds), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    graphs = llm.engine.runner.graphs
    assert graphs.replays == 21
    # The 30-token request runs through step 30; after it finishes (min_tokens: once it has 20 tokens)
    # the last steps of the 24-token request sample in the graph again.
    assert 0 < graphs.sampled < graphs.replays
    if name == "logprobs":
        for g, w in zip(got[0].outputs[0].logprobs, eager[0].outputs[0].logprobs, strict=True):
            assert g.keys() == w.keys()
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-5 for t in g)
    if name == "logits":
        torch.testing.assert_close(got[0].logits, eager[0].logits, rtol=1e-5, atol=1e-5)


def test_which_requests_sample_in_the_graph():
    def seq(**kwargs) -> Sequence:
        return Sequence(0, [1, 2], SamplingParams(max_tokens=64, **kwargs), token_ids=[1, 2, 3])

    assert samples_in_graph(seq(temperature=0))
    assert samples_in_graph(seq(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1, seed=2, stop=("x",)))
    assert samples_in_graph(seq(min_tokens=1))  # one token out: reached
    for kwargs in FALLBACKS.values():
        assert not samples_in_graph(seq(**kwargs))
    assert not samples_in_graph(seq(n=1, best_of=2))  # best_of ranks by log-probabilities
    banned = seq()
    banned.bad_word_ids = ((7,),)
    assert not samples_in_graph(banned)


def test_draw_rows_give_the_eager_draw_with_neutral_padding():
    """The static rows of 3 sequences in a bucket of 4, drawn through DrawRows, give the tokens of the
    eager SamplingBatch for the same logits; padding rows and rows without a filter are neutral."""
    kinds = [MIXED[0], MIXED[2], MIXED[4]]
    seqs = [
        Sequence(i, [1, 2], SamplingParams(**k), sample_key=1000 + i, token_ids=[1, 2, 5]) for i, k in enumerate(kinds)
    ]
    host = np.full((len(DRAW_ROWS), 8), -7, np.int64)  # stale values everywhere
    filters = write_draw_rows(host, seqs, 4)
    assert filters == Filters(min_p=True, top_k=True, top_p=False)
    rows = draw_rows(torch.from_numpy(host), 4, filters)
    assert rows.greedy.tolist() == [True, False, False, True]
    assert rows.top_k.tolist() == [TOP_K_ALL, 5, TOP_K_ALL, TOP_K_ALL]
    assert rows.top_p.tolist() == [1.0] * 4 and rows.min_p.tolist() == pytest.approx([0, 0, 0.1, 0])
    assert rows.temperature.tolist() == pytest.approx([1.0, 1.0, 1.3, 1.0])
    assert rows.steps.tolist() == [1, 1, 1, 0] and rows.keys.tolist() == [1000, 1001, 1002, 0]
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[3] = float("nan")  # a padding row's logits never reach another row
    eager = draw(logits[:3], SamplingBatch.build(seqs, set(), 50, "cpu"))
    with no_host_sync():
        static = draw(logits, rows)
    assert static[:3].tolist() == eager.tolist()
    assert write_draw_rows(host, seqs[:1], 4) is None  # all greedy: the argmax is the token
    assert write_draw_rows(host, seqs[1:2], 2) == Filters(min_p=False, top_k=True, top_p=False)
    assert write_draw_rows(host, seqs[2:], 1) == Filters(min_p=True, top_k=False, top_p=False)


def test_the_static_inputs_hold_the_draw_rows(ckpt_root):
    llm = static_llm(checkpoint("llama", ckpt_root))
    graphs = llm.engine.runner.graphs
    assert graphs.seq_inputs.shape == (DRAW + len(DRAW_ROWS), BUCKETS[-1])
    assert graphs.inputs.numel() == 2 * BUCKETS[-1] + (DRAW + len(DRAW_ROWS)) * BUCKETS[-1]  # one copy per step
