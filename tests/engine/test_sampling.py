"""The batched sampler: filters against hand-computed sets, penalties against a float64 loop,
min_tokens bans, draws that follow the distribution and do not depend on the batch, validation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    filter_logits,
    sample,
    sample_key,
    to_host,
    uniform_noise,
)
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.sequence import Sequence
from portattn.testing import no_host_sync
from tiny_models import checkpoint, hf_reference, random_prompts

EOS = 3


def make_batch(params: list[SamplingParams], outputs=None, prompts=None, keys=None, vocab=5) -> SamplingBatch:
    seqs = []
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [0]
        seq = Sequence(i, list(prompt), p, keys[i] if keys else sample_key(p.seed, 0))
        seq.token_ids += outputs[i] if outputs else []
        seqs.append(seq)
    return SamplingBatch.build(seqs, {EOS}, vocab, "cpu")


def kept(logits: torch.Tensor, params: list[SamplingParams]) -> list[list[int]]:
    out = filter_logits(logits, make_batch(params, vocab=logits.shape[-1]))
    return [row.isfinite().nonzero().flatten().tolist() for row in out]


def test_top_k_keeps_exactly_the_k_largest_per_row():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0]] * 3)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (3, 1, -1)]
    assert kept(logits, params) == [[1, 3, 4], [1], [0, 1, 2, 3, 4]]


def test_top_p_keeps_the_smallest_head_reaching_p():
    logits = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]).log().repeat(5, 1)
    cases = [(0.4, [1]), (0.41, [1, 3]), (0.7, [1, 3]), (0.71, [1, 3, 4]), (1.0, [0, 1, 2, 3, 4])]
    params = [SamplingParams(temperature=1.0, top_p=p) for p, _ in cases]
    assert kept(logits, params) == [want for _, want in cases]


def test_min_p_and_temperature_then_top_k():
    probs = torch.tensor([0.5, 0.26, 0.04, 0.2])
    logits = probs.log().repeat(3, 1)
    params = [
        SamplingParams(temperature=1.0, min_p=0.1),  # drops p < 0.05
        SamplingParams(temperature=1.0, min_p=0.5),  # drops p < 0.25
        SamplingParams(temperature=0.5, min_p=0.5, top_k=1),  # sharper: 0.26 -> 0.26^2 / sum < 0.5 * max
    ]
    assert kept(logits, params) == [[0, 1, 3], [0, 1], [0]]
    scaled = filter_logits(logits, make_batch([SamplingParams(temperature=0.5)] * 3, vocab=4))
    assert torch.allclose(scaled, logits / 0.5)


def penalized_ref(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties, one token at a time, in float64."""
    x = logits.double().clone()
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def test_penalties_match_a_float64_loop():
    g = torch.Generator().manual_seed(0)
    vocab = 11
    logits = torch.randn(4, vocab, generator=g) * 2
    prompts = [[1, 2, 2], [5], [0, 9], [4]]
    outputs = [[2, 7, 7, 7], [5, 5, 1], [], [4, 4]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, repetition_penalty=0.7),
        SamplingParams(frequency_penalty=-1.0, repetition_penalty=2.0),
        SamplingParams(),  # no penalty in a penalised batch
    ]
    batch = make_batch(params, outputs, prompts, vocab=vocab)
    got = apply_penalties(logits, batch)
    for i in range(4):
        want = penalized_ref(logits[i], prompts[i], outputs[i], params[i])
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, 6)
    logits[:, EOS] = logits[:, 5] = 10.0
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5]),  # 1 token out: both banned
        SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[5]),  # 1 token out: nothing banned
        SamplingParams(temperature=0, min_tokens=4, ignore_eos=True, stop_token_ids=[5]),  # EOS is not a stop here
    ]
    out = sample(logits, make_batch(params, outputs=[[0], [0], [0]], vocab=6)).tokens.tolist()
    assert out[0] not in (EOS, 5) and out[1] in (EOS, 5) and out[2] == EOS


def test_draws_follow_the_softmax_and_are_batch_independent():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, 2.0])
    n = 6000
    params = [SamplingParams(temperature=2.0, seed=s) for s in range(n)]
    batch = make_batch(params)
    tokens = sample(logits.repeat(n, 1), batch).tokens
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert torch.allclose(freq, torch.softmax(logits.double() / 2.0, -1), atol=0.02)
    # The same rows alone, reordered, or among other rows draw the same tokens.
    sub = [7, 3, 5000, 11]
    alone = sample(logits.repeat(4, 1), make_batch([params[i] for i in sub])).tokens
    assert alone.tolist() == tokens[sub].tolist()
    # Successive steps of one request draw fresh variates.
    u = uniform_noise(torch.tensor([12345, 12345]), torch.tensor([0, 1]), 1000)
    assert u.min() > 0 and u.max() < 1 and (u[0] - u[1]).abs().mean() > 0.2
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_greedy_rows_take_the_argmax_of_penalised_logits():
    logits = torch.tensor([[0.0, 3.0, 2.9], [0.0, 3.0, 2.9]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=0.5)]
    tokens = sample(logits, make_batch(params, outputs=[[1], [1]], vocab=3)).tokens.tolist()
    assert tokens == [1, 2]


def test_sampled_logprobs_ranks_and_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, top_k=1, logprobs=0)]
    out = sample(logits, make_batch(params, vocab=4))
    want = torch.log_softmax(logits, -1)
    assert out.tokens.tolist() == [1, 2] and out.rows.tolist() == [0, 1]
    torch.testing.assert_close(out.logprob, want[[0, 1], [1, 2]])
    assert out.rank.tolist() == [1, 1]
    assert out.top_ids[0].tolist() == [1, 2]


def test_sampling_makes_no_host_sync_and_one_transfer_per_step(ckpt_root, monkeypatch):
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=3, seed=1),
        SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=3),
        SamplingParams(temperature=1.0, frequency_penalty=0.1),
    ]
    batch = make_batch(params, outputs=[[1, 2], [3], [4, 4], []], vocab=50)
    with no_host_sync():  # the whole batch on the device: no value read back while sampling
        sample(logits, batch)
    from portattn.engine import model_runner

    calls = []
    real = model_runner.HostCopy
    monkeypatch.setattr(model_runner, "HostCopy", lambda parts: calls.append(len(parts)) or real(parts))
    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=64, max_model_len=256)
    sp = SamplingParams(n=2, max_tokens=5, temperature=1.0, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    llm.generate(random_prompts([5, 9]), sp, use_tqdm=False)
    assert len(calls) == 5  # one copy per step (the first also carries the prompt log-probabilities)


def test_to_host_round_trips_ids_and_float32_exactly():
    parts = [torch.tensor([2**40 + 3, -7]), torch.randn(3, 2), torch.tensor([[1, 2]], dtype=torch.int32)]
    back = to_host(parts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(parts, back))


def test_seeded_requests_do_not_depend_on_the_batch(ckpt_root):
    llm = LLM(checkpoint("qwen3", ckpt_root), page_size=16, num_pages=64, max_model_len=1024)
    prompts = random_prompts([6, 11, 19], seed=3)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = llm.generate([prompts[1]], p, use_tqdm=False)[0].token_ids
    batched = llm.generate(prompts, [SamplingParams(max_tokens=5, temperature=1.0), p, p], use_tqdm=False)
    assert batched[1].token_ids == alone
    other = llm.generate([prompts[1]], SamplingParams(max_tokens=12, temperature=1.0, seed=124, ignore_eos=True))
    assert other[0].token_ids != alone
    greedy_k1 = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True))
    assert greedy_k1[0].token_ids == hf_reference(llm.config.model, tuple(prompts[0]), 12)[0]


def test_seeded_requests_survive_preemption(ckpt_root):
    """A preempted request recomputes and draws the same tokens (the variates are keyed by position)."""
    path = checkpoint("llama", ckpt_root)
    prompts = random_prompts([9] * 6, seed=4)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in range(6)]
    roomy = LLM(path, page_size=4, num_pages=64, max_model_len=64).generate(prompts, params, use_tqdm=False)
    tight = LLM(path, page_size=4, num_pages=16, max_model_len=64)
    cramped = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in cramped] == [o.token_ids for o in roomy]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ],
)
def test_bad_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=f"expected {match}"):
        SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)
