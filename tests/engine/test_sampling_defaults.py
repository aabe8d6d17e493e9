"""vLLM's sampling defaults: ``SamplingParams()`` samples at temperature 1, a checkpoint's
``generation_config.json`` supplies the values a request leaves unset (unless ``generation_config="vllm"``),
``max_tokens=None`` runs up to the context, and ``portattn generate`` follows the same defaults."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
from pathlib import Path

import pytest

from portattn.cli import main
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams
from portattn.testing.chat import save_tiny_chat_checkpoint

ENGINE = dict(page_size=4, num_pages=64, max_model_len=128)
PROMPT = [5, 17, 33, 61, 90]
# What a released checkpoint's file looks like: the five values vLLM reads, and keys it does not.
RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


@functools.cache
def _base(root: str) -> str:
    return save_tiny_chat_checkpoint(f"{root}/base")


def with_generation_config(root: Path, name: str, values: dict) -> str:
    """A copy of the tiny chat checkpoint whose generation_config.json also holds ``values``."""
    path = root / name
    if not path.exists():
        shutil.copytree(_base(str(root)), path)
        file = path / "generation_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **values}))
    return str(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("genconfig")


def test_default_params_sample_at_temperature_one_as_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)
    assert not p.greedy and p.max_tokens == 16 and p.unset == set(GENERATION_CONFIG_FIELDS)
    assert type(p.temperature) is float and type(p.top_k) is int  # the markers do not leak out
    greedy = SamplingParams(temperature=0)
    assert greedy.greedy and greedy.unset == set(GENERATION_CONFIG_FIELDS) - {"temperature"}
    assert SamplingParams(temperature=1.0, top_k=-1).unset == {"top_p", "min_p", "repetition_penalty"}
    assert SamplingParams() == SamplingParams(temperature=1.0)  # equal values, whatever was given
    filled = SamplingParams(top_p=0.5).with_defaults({"temperature": 0.7, "top_p": 0.9})
    assert (filled.temperature, filled.top_p) == (0.7, 0.5) and "temperature" not in filled.unset


def test_generation_config_values_are_the_defaults_of_unset_fields(root, caplog):
    path = with_generation_config(root, "recommended", {**RECOMMENDED, "do_sample": True, "max_new_tokens": 9})
    with caplog.at_level(logging.INFO, logger="portattn"):
        llm = LLM(path, **ENGINE)
    applied = [r for r in caplog.records if "sampling defaults from" in r.getMessage()]
    assert len(applied) == 1 and "temperature=0.6, top_p=0.95, top_k=20, min_p=0.05" in applied[0].getMessage()
    assert str(Path(path) / "generation_config.json") in applied[0].getMessage()

    default = llm.get_default_sampling_params()
    assert {name: getattr(default, name) for name in GENERATION_CONFIG_FIELDS} == RECOMMENDED
    assert dataclasses.replace(default, **{k: getattr(SamplingParams(), k) for k in RECOMMENDED}) == SamplingParams()
    assert default.unset == set()
    # A request's unset fields take the file's values; those it sets stay.
    engine = llm.engine
    seq = engine.add_request(PROMPT, SamplingParams(top_p=0.5, top_k=-1))
    engine.abort(seq.request_id)
    got = {name: getattr(seq.params, name) for name in GENERATION_CONFIG_FIELDS}
    assert got == {**RECOMMENDED, "top_p": 0.5, "top_k": -1}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="portattn"):
        llm.generate([PROMPT, PROMPT], use_tqdm=False)
    assert "sampling defaults" not in caplog.text  # logged once, when the engine loads

    vllm = LLM(path, generation_config="vllm", **ENGINE).get_default_sampling_params()
    assert vllm == SamplingParams() and vllm.unset == set(GENERATION_CONFIG_FIELDS)


def test_a_greedy_generation_config_makes_unset_requests_greedy(root):
    path = with_generation_config(root, "greedy", {"temperature": 0.0})
    llm = LLM(path, **ENGINE)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert llm.generate([PROMPT], SamplingParams(ignore_eos=True), use_tqdm=False)[0].token_ids == greedy
    unset = llm.generate([PROMPT], use_tqdm=False)[0].token_ids  # None: the same defaults (stops at EOS)
    assert unset == greedy[: len(unset)]
    sampled = SamplingParams(temperature=1.0, seed=5, ignore_eos=True)
    explicit = llm.generate([PROMPT], sampled, use_tqdm=False)[0].token_ids
    assert explicit != greedy  # a request that sets temperature keeps it
    vllm = LLM(path, generation_config="vllm", **ENGINE)
    assert vllm.generate([PROMPT], SamplingParams(seed=5, ignore_eos=True), use_tqdm=False)[0].token_ids == explicit


def test_generation_config_folder_and_bad_values(root, tmp_path):
    folder = tmp_path / "recommended"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 0, "top_p": 0.8, "temperature": None}))
    llm = LLM(_base(str(root)), generation_config=folder, **ENGINE)
    params = llm.get_default_sampling_params()
    assert (params.top_k, params.top_p, params.temperature) == (-1, 0.8, 1.0)  # top_k 0 is "no limit"; null unset
    with pytest.raises(ValueError, match="expected generation_config to be 'auto', 'vllm' or a folder holding"):
        LLM(_base(str(root)), generation_config=str(tmp_path / "nowhere"), **ENGINE)
    bad = with_generation_config(root, "bad", {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"sampling values that SamplingParams accepts in .*bad.*top_p in \(0, 1\]"):
        LLM(bad, **ENGINE)
    with pytest.raises(ValueError, match="expected generation_config"):
        LLM(_base(str(root)), generation_config=3, **ENGINE)


def test_max_tokens_none_runs_to_the_context(root):
    llm = LLM(_base(str(root)), **ENGINE)
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == ENGINE["max_model_len"] - len(PROMPT) and out.finish_reason == "length"
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    with pytest.raises(ValueError, match="expected max_tokens to be an int >= 1"):
        SamplingParams(max_tokens=0)


def test_generate_command_takes_the_checkpoint_defaults(root, capsys):
    path = with_generation_config(root, "greedy", {"temperature": 0.0})
    argv = ["generate", "--model", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "6"]
    argv += ["--ignore-eos", "--page-size", "4", "--num-pages", "64", "--max-model-len", "128"]
    want = LLM(path, **ENGINE).generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    capsys.readouterr()
    assert main(argv) == 0
    assert f"output: {want.text!r}" in capsys.readouterr().out
    assert main([*argv, "--generation-config", "vllm", "--seed", "5"]) == 0
    assert f"output: {want.text!r}" not in capsys.readouterr().out
