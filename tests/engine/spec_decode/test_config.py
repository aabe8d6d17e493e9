"""``speculative_config`` as vLLM spells it: the keyword and ``--speculative-config JSON`` on ``generate``
and ``serve``, every unknown key or method and every bad value refused with what was expected;
``disable_by_batch_size`` turns speculation off above a batch size and says so; proposals give way
before the scheduler preempts."""

from __future__ import annotations

import json
import logging
import re

import pytest

from portattn.cli import main
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from tiny_models import checkpoint, random_prompts

from .helpers import use_oracle


@pytest.mark.parametrize(
    "value,message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method among ['ngram', 'draft_model'], got 'eagle'"),
        ({"num_speculative_tokens": 2, "tree": 1}, "got unknown ['tree']"),
        ({"method": "ngram"}, "num_speculative_tokens, got none"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens to be an int >= 1, got 0"),
        ({"num_speculative_tokens": 2}, "method ('ngram') or model (a draft checkpoint), got neither"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "d"}, "no speculative_config model for method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model (a draft checkpoint) for method"),
        ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max only with method"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min <= prompt_lookup_max 2, got 4",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max to be an int"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("{method: ngram}", "speculative_config to be a JSON object, got '{method: ngram}'"),
        ("[1, 2]", "speculative_config to be a dict (or a JSON object), got [1, 2]"),
    ],
)
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SpeculativeConfig.parse(value)


def test_defaults_as_vllm_sets_them():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).as_dict() == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 5,
        "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE,
    }
    always = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": null}')
    assert always.disable_by_batch_size is None and SpeculativeConfig.parse(always.as_dict()) == always
    one = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    draft = SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 2})
    assert draft.method == "draft_model" and draft.model == "/d"


def test_generate_takes_speculative_config_json(ckpt_root, capsys):
    path = checkpoint("llama", ckpt_root)
    argv = ["generate", "--model", path, "--prompt-ids", "3,1,4,1,5,3,1,4", "--max-tokens", "7", "--temperature", "0"]
    argv += ["--ignore-eos", "--max-model-len", "32", "--num-pages", "4"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert main([*argv, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out == plain
    assert main([*argv, "--speculative-config", '{"num_speculative_tokens": 3, "method": "medusa"}']) == 2
    assert "error: expected speculative_config method among ['ngram', 'draft_model'], got 'medusa'" in (
        capsys.readouterr().err
    )


def test_disable_by_batch_size_turns_speculation_off_and_on(ckpt_root, caplog):
    path = checkpoint("llama", ckpt_root)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2}
    with caplog.at_level(logging.INFO, logger="portattn"):
        llm = LLM(path, page_size=4, num_pages=40, max_model_len=40, speculative_config=spec)
    assert "pauses in steps that start with more than 2 running sequences" in caplog.text
    caplog.clear()
    prompts = random_prompts([3, 5, 7], seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 14, 14)]
    llm.engine.speculator.paused = True
    plain = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.speculator.paused = False
    oracle = use_oracle(llm, prompts, plain, wrong=False)
    seen = []
    propose = oracle.propose
    oracle.propose = lambda requests: seen.append(len(llm.engine.scheduler.running)) or propose(requests)
    with caplog.at_level(logging.INFO, logger="portattn"):
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert seen and max(seen) <= 2  # three running: no proposals until the first finished
    logs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speculative decoding o")]
    assert logs[:2] == [
        "speculative decoding off: 3 running sequences, disable_by_batch_size 2",
        "speculative decoding on again: 2 running sequences, disable_by_batch_size 2",
    ]


def test_proposals_give_way_before_a_preemption(ckpt_root):
    # 6 pages of 4 tokens hold two sequences of 12 tokens exactly: 1 + k tokens near their ends do not fit.
    path = checkpoint("qwen3", ckpt_root)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(path, page_size=4, num_pages=6, max_model_len=24, max_num_seqs=2, speculative_config=spec)
    prompts = random_prompts([5, 5], seed=3)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    llm.engine.speculator.paused = True
    plain = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.speculator.paused = False
    use_oracle(llm, prompts, plain, wrong=False)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in plain]
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.speculator.stats.num_drafts > 0
