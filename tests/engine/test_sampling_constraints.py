"""vLLM's request constraints: ``allowed_token_ids``, ``bad_words``, ``logits_processors``,
``truncate_prompt_tokens`` and ``best_of``, in the batched sampler and through ``LLM``."""

from __future__ import annotations

import functools

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampler import SamplingBatch, bad_word_bans, sample, sample_key
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.sequence import Sequence
from portattn.testing import no_host_sync
from portattn.testing.chat import save_tiny_chat_checkpoint

EOS = 3
PROMPT = [5, 17, 33, 61, 90, 7, 44]


def make_batch(params: list[SamplingParams], outputs=None, vocab=8, bad_words=None) -> SamplingBatch:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(i, [0], p, sample_key(p.seed, 0))
        seq.token_ids += outputs[i] if outputs else []
        seq.bad_word_ids = bad_words[i] if bad_words else ()
        seqs.append(seq)
    return SamplingBatch.build(seqs, {EOS}, vocab, "cpu")


@functools.cache
def _checkpoint(root: str) -> str:
    return save_tiny_chat_checkpoint(f"{root}/chat")


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(_checkpoint(str(tmp_path_factory.mktemp("tiny"))), page_size=4, num_pages=64, max_model_len=128)


def greedy(llm: LLM, prompt, **kwargs) -> list[int]:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kwargs})
    return llm.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_allowed_token_ids_restrict_greedy_and_sampled_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=g)
    logits[:, 6] = 9.0  # the likeliest token of every row, allowed in none of the restricted ones
    params = [
        SamplingParams(temperature=0, allowed_token_ids=[2, 5]),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, allowed_token_ids=(7,)),
    ]
    tokens = sample(logits, make_batch(params)).tokens.tolist()
    assert tokens == [2 if logits[0, 2] > logits[0, 5] else 5, 6, 7]
    n, allowed = 4000, [1, 4, 6]
    rows = [SamplingParams(temperature=1.0, seed=s, allowed_token_ids=allowed) for s in range(n)]
    drawn = sample(logits[0].repeat(n, 1), make_batch(rows)).tokens
    freq = torch.bincount(drawn, minlength=8).double() / n
    want = torch.zeros(8, dtype=torch.float64)
    want[allowed] = torch.softmax(logits[0, allowed].double(), -1)
    assert torch.allclose(freq, want, atol=0.03)  # the distribution renormalised over the allowed tokens


def test_bad_words_ban_the_last_token_when_the_rest_ends_the_output():
    words = ((4,), (6, 7, 2), (1, 5))
    seq = Sequence(0, [6, 7], SamplingParams(), 0)  # the prompt does not count: only the output
    seq.bad_word_ids = words
    assert bad_word_bans(seq) == {4}
    seq.token_ids += [6, 7]
    assert bad_word_bans(seq) == {4, 2}
    seq.token_ids += [1]
    assert bad_word_bans(seq) == {4, 5}
    logits = torch.zeros(2, 8)
    logits[:, 5] = logits[:, 4] = 5.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    out = sample(logits, make_batch(params, outputs=[[1], [1]], bad_words=[words, ()])).tokens.tolist()
    assert out[0] not in (4, 5) and out[1] in (4, 5)


def test_bad_words_never_complete_in_the_output(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    words = [w for w in full.text.split() if w.isascii() and w.isalpha()]
    word = max(words, key=words.count)  # a word the model writes unprompted, often
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word])
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    got = out.token_ids
    forms = [llm.tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert all(got[i : i + len(f)] != f for f in forms for i in range(len(got))), "a bad word's tokens were generated"
    assert word not in out.text.split() and word in full.text.split()
    ids = full.token_ids  # the same tokens up to where the unconstrained output starts the word
    first = min(i for f in forms for i in range(len(ids)) if ids[i : i + len(f)] == f)
    assert got[:first] == ids[:first] and got != ids
    with pytest.raises(ValueError, match="expected bad_words to be a list of non-blank strs"):
        SamplingParams(bad_words=[" "])


def test_logits_processors_run_per_row_in_order(llm):
    calls = []

    def force(token):
        def processor(output_ids, logits):
            calls.append((token, list(output_ids)))
            out = torch.full_like(logits, float("-inf"))
            out[token] = 0.0
            return out

        return processor

    def prompt_aware(prompt_ids, output_ids, logits):
        assert prompt_ids == PROMPT[::-1]
        return logits

    alone = greedy(llm, PROMPT)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logits_processors=[force(9), force(11)]),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logits_processors=[prompt_aware]),
    ]
    outs = llm.generate([PROMPT, PROMPT, PROMPT[::-1]], params, use_tqdm=False)
    assert outs[0].token_ids == [11] * 12  # the later processor sees the earlier one's output
    assert outs[1].token_ids == alone  # rows without processors are untouched
    assert outs[2].token_ids == greedy(llm, PROMPT[::-1])
    assert calls == [(t, [11] * i) for i in range(12) for t in (9, 11)]  # in order, each step, with the output so far
    bad = SamplingParams(temperature=0, logits_processors=[lambda ids, logits: logits[:3]])
    with pytest.raises(ValueError, match=r"expected logits_processors to return a tensor of shape \[\d+\], got"):
        llm.generate([PROMPT], bad, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="expected logits_processors to be a list of callables"):
        SamplingParams(logits_processors=[3])


def test_constraints_make_no_host_sync():
    params = [
        SamplingParams(temperature=0.7, seed=1, allowed_token_ids=[1, 2, 6]),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=2, min_tokens=3),
    ]
    batch = make_batch(params, outputs=[[6, 7], [1], []], bad_words=[((6, 7, 2),), ((5,),), ()])
    with no_host_sync():
        sample(torch.randn(3, 8), batch)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    long = list(range(10, 60))
    out = llm.generate([long], SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=9))[0]
    assert out.prompt_token_ids == long[-9:] and out.token_ids == greedy(llm, long[-9:])[:6]
    too_long = list(range(10, 10 + 200))  # beyond max_model_len 128
    with pytest.raises(ValueError, match="shorter than max_model_len 128"):
        llm.generate([too_long], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = llm.generate([too_long], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == too_long[-127:] and len(out.token_ids) == 1  # room for one token
    assert SamplingParams(truncate_prompt_tokens=100).truncate(long, 128) == long
    with pytest.raises(ValueError, match="expected truncate_prompt_tokens to be None, -1 or an int >= 1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_best_of_returns_the_n_likeliest_of_its_sequences(llm):
    common = dict(temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    every = llm.generate([PROMPT], SamplingParams(n=5, logprobs=0, **common), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in every}) == 5
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=5, **common), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]  # choice i of both draws (seed, i)
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert [c.index for c in best] == [0, 1] and all(c.logprobs is None for c in best)
    same = llm.generate([PROMPT], SamplingParams(n=2, best_of=2, **common), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in same] == [c.token_ids for c in every[:2]]  # best_of == n changes nothing
    with pytest.raises(ValueError, match="expected best_of to be an int >= 3, got 2"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="expected best_of == n in a stream"):
        llm.stream([PROMPT], SamplingParams(n=1, best_of=2))
    assert not llm.engine.has_unfinished()


def test_allowed_token_ids_are_checked_against_the_vocabulary(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=f"expected allowed_token_ids below the vocabulary size {vocab}"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[1, vocab]), use_tqdm=False)
    with pytest.raises(ValueError, match="expected allowed_token_ids to be None or a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    got = llm.generate([PROMPT], SamplingParams(max_tokens=10, seed=3, allowed_token_ids=[40, 41, 42]))[0]
    assert set(got.token_ids) <= {40, 41, 42}
