"""A draft model run by the engine's machinery: equal to the target it accepts every proposal (greedy
and sampled), through its own static-buffer path at q = 2 and q = 1 and the target's at q = k + 1;
another draft keeps the target's distribution exactly (a chi-square test calibrated against two
plain runs, and shown to reject the draft's own distribution); seeded runs repeat; a draft with
another vocabulary or tokenizer is refused, naming the mismatch."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.page_manager import PageManager
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.sequence import Sequence
from portattn.engine.spec_decode.draft_model import DraftModelProposer
from portattn.testing import save_tiny_checkpoint
from portattn.testing.chat import save_tiny_chat_checkpoint
from tiny_models import checkpoint, random_prompts

from ..test_interrupted_bookkeeping import FILES, LineTrace, assert_pools_consistent
from .helpers import assert_draft_pools_consistent

K = 3
PROMPTS = random_prompts([4, 11, 1, 23], seed=8)


def draft_llm(path: str, draft: str, **kwargs) -> LLM:
    kwargs = dict(page_size=4, num_pages=120, max_model_len=64, max_num_seqs=4) | kwargs
    return LLM(
        path, speculative_config={"model": draft, "num_speculative_tokens": K, "disable_by_batch_size": None}, **kwargs
    )


def test_a_draft_equal_to_the_target_accepts_every_proposal(ckpt_root):
    path = checkpoint("qwen2", ckpt_root)
    llm = draft_llm(path, path, enable_prefix_caching=True)
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    engine.runner.enable_graphs((1, 2, 4), capture=False).capture_all()  # the static path, run eagerly
    proposer.runner.enable_graphs((1, 2, 4), capture=False).capture_all()
    greedy = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    engine.speculator.paused = True
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    engine.speculator.paused = False
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == want
    stats = engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens == K * stats.num_drafts
    assert stats.accepted_per_pos == [stats.num_drafts] * K
    assert set(engine.runner.graphs.padded) <= {3} and engine.runner.graphs.replays > 0
    draft_graphs = proposer.runner.graphs
    assert draft_graphs.replays >= 2 * stats.num_drafts // len(PROMPTS)  # the catch-up (q = 2) and q = 1 steps
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True, seed=7)
    before = stats.snapshot()
    llm.generate(PROMPTS, sampled, use_tqdm=False)
    after = engine.speculator.stats
    assert after.num_draft_tokens > before.num_draft_tokens
    assert after.num_accepted_tokens - before.num_accepted_tokens == after.num_draft_tokens - before.num_draft_tokens
    assert not proposer.shadows  # every request finished: the draft holds nothing but its cache
    assert_draft_pools_consistent(proposer)
    assert_pools_consistent(engine)


def perturbed_copy(path: str, dest: Path, scale: float) -> str:
    """The checkpoint at ``path`` with Gaussian noise of ``scale`` times each tensor's spread added: a
    draft that agrees with the target often, not always."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        (dest / name).write_bytes((Path(path) / name).read_bytes())
    weights = load_file(Path(path) / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    noisy = {k: w + scale * w.std().nan_to_num() * torch.randn(w.shape, generator=g) for k, w in weights.items()}
    save_file(noisy, dest / "model.safetensors", metadata={"format": "pt"})
    return str(dest)


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that samples ``a`` and ``b`` come from one distribution (bins
    with fewer than 5 expected in either sample pooled)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    bins, rare = [], [0, 0]
    for token in sorted(set(ca) | set(cb)):
        total = ca[token] + cb[token]
        if total * min(na, nb) / (na + nb) < 5:
            rare[0] += ca[token]
            rare[1] += cb[token]
        else:
            bins.append((ca[token], cb[token]))
    if sum(rare):
        bins.append(tuple(rare))
    obs = torch.tensor(bins, dtype=torch.float64)  # [bins, 2]
    expected = obs.sum(1, keepdim=True) * torch.tensor([na, nb], dtype=torch.float64) / (na + nb)
    stat = ((obs - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(bins) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def samples(llm: LLM, seed: int, n: int) -> list[list[int]]:
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True, n=n, seed=seed)
    return [c.token_ids for c in llm.generate([[3, 1, 4]], params, use_tqdm=False)[0].outputs]


def test_another_draft_keeps_the_target_distribution(ckpt_root, tmp_path):
    path = checkpoint("llama", ckpt_root)
    draft = perturbed_copy(path, tmp_path / "draft", 0.1)
    kwargs = dict(page_size=4, num_pages=600, max_model_len=16, max_num_seqs=64, enable_prefix_caching=True)
    llm = draft_llm(path, draft, **kwargs)
    n = 1500
    llm.engine.speculator.paused = True
    plain_a, plain_b = samples(llm, 1, n), samples(llm, 2, n)
    llm.engine.speculator.paused = False
    spec = samples(llm, 3, n)
    stats = llm.engine.speculator.stats
    assert 0.1 < stats.acceptance_rate < 0.9  # proposals accepted and rejected (residual draws)
    draft_only = samples(LLM(draft, **kwargs), 4, n)
    for position in (1, 2):  # the tokens speculation verified (position 0 comes from the prefill)
        a, b, s, d = ([t[position] for t in x] for x in (plain_a, plain_b, spec, draft_only))
        calibration = chi_square_p(a, b)
        assert calibration > 1e-3, calibration  # two plain runs: the test sees one distribution
        assert chi_square_p(s, a) > 1e-3 and chi_square_p(s, b) > 1e-3
        assert chi_square_p(d, a) < 1e-6  # and it tells the draft's distribution apart
    assert_draft_pools_consistent(llm.engine.speculator.proposer)


def test_seeded_runs_with_a_draft_model_repeat(ckpt_root):
    path = checkpoint("gemma2", ckpt_root)
    draft = save_tiny_checkpoint("gemma2", f"{ckpt_root}/gemma2_draft", seed=5)
    llm = draft_llm(path, draft, page_size=5, num_pages=60, chunked_prefill_size=8, enable_prefix_caching=True)
    params = [
        SamplingParams(temperature=0.9, top_k=30, seed=3, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ] * 2
    first, second = (llm.generate(PROMPTS, params, use_tqdm=False) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    for a, b in zip(first[0::2], second[0::2]):  # the second run reads the first's cached prefixes
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(pa) == list(pb)
            assert [v.logprob for v in pa.values()] == pytest.approx([v.logprob for v in pb.values()], abs=1e-5)
    llm.engine.speculator.paused = True
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    assert first[1].token_ids == plain[1].token_ids and first[3].token_ids == plain[3].token_ids  # greedy
    assert 0 < llm.engine.speculator.stats.num_accepted_tokens < llm.engine.speculator.stats.num_draft_tokens
    assert_draft_pools_consistent(llm.engine.speculator.proposer)


def test_a_draft_with_another_vocabulary_is_refused(ckpt_root, tmp_path):
    path = checkpoint("llama", ckpt_root)
    other = save_tiny_checkpoint("llama", tmp_path / "vocab300", vocab_size=300)
    with pytest.raises(ValueError, match=r"target's vocabulary \(vocab_size 256\), got vocab_size 300 in .*vocab300"):
        draft_llm(path, other)
    chat = save_tiny_chat_checkpoint(tmp_path / "chat", vocab_size=384)
    smaller = Path(save_tiny_chat_checkpoint(tmp_path / "chat320", vocab_size=320))
    config = json.loads((smaller / "config.json").read_text())
    (smaller / "config.json").write_text(json.dumps(config | {"vocab_size": 384}))  # same size, other tokenizer
    with pytest.raises(ValueError, match=r"target's tokenizer, got a different one in .*chat320 \(token '.*' is id"):
        draft_llm(chat, str(smaller))


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_a_shadow_dropped_part_way_is_dropped_by_the_next_release(exc, ckpt_root, monkeypatch):
    """An exception at any line of dropping a shadow (its request ended, or the draft's pool is full)
    leaves it known until it holds nothing: the next release gives back every page and row."""
    path = checkpoint("llama", ckpt_root)
    proposer = draft_llm(path, path, enable_prefix_caching=True).engine.speculator.proposer
    drop = DraftModelProposer._drop.__code__
    release = PageManager.release_all.__code__  # what _drop calls: the pages, then the request row
    monkeypatch.setitem(FILES, drop.co_filename, {"_drop"})
    monkeypatch.setitem(FILES, release.co_filename, {"release", "release_all"})
    files = {drop.co_filename, release.co_filename}

    def new_shadow():
        seq = Sequence(1, PROMPTS[3], SamplingParams(temperature=0))
        shadow, _ = proposer._catch_up(seq, K, float("inf"))  # a request row, pages for its tokens
        assert shadow.req_pool_idx is not None and shadow.pages

    new_shadow()
    counted = LineTrace()
    counted.run(lambda: proposer.release(set()))
    lines = sorted((file, line) for file, line in counted.hits if file in files)
    assert len(lines) >= 5
    for file, line in lines:
        new_shadow()
        trace = LineTrace((file, line), 1, exc)
        with contextlib.suppress(exc):
            trace.run(lambda: proposer.release(set()))
        assert trace.fired
        proposer.release(set())
        assert not proposer.shadows, (file, line)
        assert_draft_pools_consistent(proposer)
