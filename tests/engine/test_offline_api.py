"""The offline API as vLLM users write it: the output classes from the package, get_tokenizer, the
engine seed, NumPy token ids, prefix caching by default and a progress bar that counts prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import portattn
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import save_tiny_chat_checkpoint
from tiny_models import checkpoint, random_prompts

PROMPTS = random_prompts([5, 12, 9], seed=3)


@pytest.fixture(scope="module")
def llm(ckpt_root) -> LLM:
    return LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=64, max_model_len=64)


def test_output_classes_come_from_the_package(llm):
    from portattn import CompletionOutput, RequestOutput

    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    assert {"RequestOutput", "CompletionOutput"} <= set(portattn.__all__)


def test_get_tokenizer(tmp_path):
    chat = LLM(save_tiny_chat_checkpoint(tmp_path / "chat"), max_model_len=64)
    tokenizer = chat.get_tokenizer()
    assert tokenizer is chat.tokenizer and tokenizer.decode(tokenizer("Hello there")["input_ids"][1:]) == "Hello there"


def test_the_engine_seed_seeds_requests_without_one(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    kwargs = dict(page_size=4, num_pages=64, max_model_len=64)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    runs = [
        [o.token_ids for o in LLM(path, seed=seed, **kwargs).generate(PROMPTS, params, use_tqdm=False)]
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({tuple(ids) for ids in runs[0]}) == 3
    seeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=5)  # its own seed wins
    own = [LLM(path, seed=s, **kwargs).generate(PROMPTS[:1], seeded, use_tqdm=False)[0].token_ids for s in (7, 8)]
    assert own[0] == own[1]


def test_numpy_token_ids(llm):
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    want = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    arrays = [np.array(p, dtype=np.int64) for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(arrays, params, use_tqdm=False)] == want
    assert llm.generate(arrays[1], params, use_tqdm=False)[0].token_ids == want[1]  # one array, one prompt
    assert llm.generate({"prompt_token_ids": arrays[2]}, params, use_tqdm=False)[0].token_ids == want[2]
    listed = [np.int32(t) for t in PROMPTS[0]]
    out = llm.generate([listed], params, use_tqdm=False)[0]
    assert out.token_ids == want[0] and all(type(t) is int for t in out.prompt_token_ids)
    assert llm.generate(torch.tensor(PROMPTS[1]), params, use_tqdm=False)[0].token_ids == want[1]
    with pytest.raises(ValueError, match=r"expected token ids as a 1-D integer array, got 2-D of dtype int64"):
        llm.generate([np.array([PROMPTS[0][:4]] * 2)], params, use_tqdm=False)
    with pytest.raises(ValueError, match="expected token ids as a 1-D integer array, got 1-D of dtype float32"):
        llm.generate(np.array(PROMPTS[0], dtype=np.float32), params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_prefix_caching_is_on_by_default(llm):
    assert llm.config.enable_prefix_caching
    prompt = random_prompts([21], seed=4)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    before = llm.engine.pages.num_cached_tokens
    llm.generate([[*prompt[:16], 3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.pages.num_cached_tokens - before == 16  # four full pages of 4 came from the cache


def test_kv_cache_usage_leaves_out_the_pages_only_the_prefix_cache_holds(llm):
    """After every request has finished, the prefix cache keeps the full pages: held, evictable, not in use
    (the gauge read them as in use before); the evictable count is the cached pages nobody else holds."""
    llm.generate(random_prompts([23, 30], seed=6), SamplingParams(max_tokens=3), use_tqdm=False)
    alloc, cache = llm.engine.allocator, llm.engine.pages.cache
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert alloc.num_used == len(cache) > 0 and alloc.num_evictable == len(cache)
    assert metrics["portattn:kv_cache_usage_perc"] == 0.0


def test_the_progress_bar_counts_prompts_and_tokens_per_second(llm, capsys):
    llm.generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True))
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("Processed prompts: 100%") and " 3/3 " in bar
    assert "input: " in bar and " toks/s, output: " in bar
