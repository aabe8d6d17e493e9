"""A stop token, an end-of-sequence token, a stop string or max_tokens inside an accepted run ends the
request exactly where plain decoding ends it: the same tokens, text, finish and stop reasons,
log-probabilities and logits; the accepted tokens after it are dropped and its pages go back."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing.chat import save_tiny_chat_checkpoint

from ..test_interrupted_bookkeeping import assert_pools_consistent
from .helpers import use_oracle

K = 4


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    path = save_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")
    spec = {"method": "ngram", "num_speculative_tokens": K}
    return LLM(path, page_size=3, num_pages=200, max_model_len=96, max_num_seqs=8, speculative_config=spec)


def outputs(llm, prompts, params, speculate: bool, wrong: bool = False):
    spec = llm.engine.speculator
    spec.paused = True
    plain = llm.generate(prompts, params, use_tqdm=False)
    if not speculate:
        return plain
    spec.paused = False
    use_oracle(llm, prompts, plain, wrong)  # right proposals: every stop falls inside an accepted run
    return llm.generate(prompts, params, use_tqdm=False)


def test_stops_inside_accepted_runs_end_as_plain_decoding(chat_llm):
    llm = chat_llm
    prompts = ["The quick brown fox", "Rivers run to the sea", "Numbers such as 1, 2"]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = [o.outputs[0] for o in outputs(llm, prompts, free, speculate=False)]
    eos = base[1].token_ids[6]
    cases = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[base[0].token_ids[5]], logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[base[0].token_ids[5]], min_tokens=7),
        SamplingParams(temperature=0, max_tokens=24, stop=[base[1].text[8:12]], return_logits=True),
        SamplingParams(temperature=0, max_tokens=24, stop=[base[2].text[5:9]], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=0, return_logits=True),
        SamplingParams(temperature=0, max_tokens=24, logprobs=1),  # ends at the end-of-sequence token
    ]
    eos_ids = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {eos}  # a token this prompt reaches, as the model's end-of-sequence
    try:
        for params in cases:
            want = outputs(llm, prompts, params, speculate=False)
            before = llm.engine.speculator.stats.snapshot()
            got = outputs(llm, prompts, params, speculate=True)
            assert llm.engine.speculator.stats.num_accepted_tokens > before.num_accepted_tokens
            for g, w in zip(got, want, strict=True):
                gc, wc = g.outputs[0], w.outputs[0]
                assert gc.token_ids == wc.token_ids and gc.text == wc.text
                assert (gc.finish_reason, gc.stop_reason) == (wc.finish_reason, wc.stop_reason)
                assert gc.logprobs == wc.logprobs or [list(p) for p in gc.logprobs] == [list(p) for p in wc.logprobs]
                if wc.logits is not None:
                    assert gc.logits.shape == wc.logits.shape
            assert {o.finish_reason for o in want} != {"length"} or params.max_tokens == 7
            assert_pools_consistent(llm.engine)
    finally:
        llm.engine.eos_token_ids = eos_ids
    llm.engine.pages.clear_cache()  # (prefix caching is on by default)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
