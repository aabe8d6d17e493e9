"""What a user gets without asking: the device and dtype, the per-step token budget and its older
name, decodes first within the budget."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import portattn.engine.config as config_module
from portattn.engine.config import EngineConfig, auto_dtype
from portattn.engine.forward_batch import ForwardBatch
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import checkpoint, hf_reference, random_prompts


def test_the_cpu_defaults(caplog, monkeypatch):
    monkeypatch.delenv("PORTATTN_DEVICE")  # tests/conftest.py keeps the engine on the CPU through it
    monkeypatch.setattr(config_module, "default_device", lambda: torch.device("cpu"))  # a machine without GPU
    with caplog.at_level(logging.INFO, logger="portattn"):
        config = EngineConfig(model="m")
    assert config.device == torch.device("cpu") and "device auto: cpu (no accelerator here)" in caplog.text
    assert config.dtype == torch.float32
    assert config.enable_prefix_caching
    assert config.max_num_batched_tokens == config.chunked_prefill_size == 2048


@pytest.fixture
def bf16_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    return str(tmp_path)


def test_the_accelerator_is_the_default_device_with_the_checkpoints_dtype(bf16_checkpoint, monkeypatch, caplog):
    monkeypatch.delenv("PORTATTN_DEVICE")
    monkeypatch.setattr(config_module, "default_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(config_module, "resolve_device", torch.device)  # as if this machine had the GPU
    with caplog.at_level(logging.INFO, logger="portattn"):
        config = EngineConfig(model=bf16_checkpoint)
    assert config.device == torch.device("cuda", 0) and "device auto: cuda:0 (the accelerator)" in caplog.text
    assert config.dtype == torch.bfloat16 and config.kv_cache_dtype == torch.bfloat16
    assert config.max_num_batched_tokens == 8192
    # On the CPU the same checkpoint runs in float32.
    assert EngineConfig(model=bf16_checkpoint, device="cpu").dtype == torch.float32
    # $PORTATTN_DEVICE decides what auto means (the tests keep the engine on the CPU with it).
    monkeypatch.setenv("PORTATTN_DEVICE", "cpu")
    with caplog.at_level(logging.INFO, logger="portattn"):
        assert EngineConfig(model=bf16_checkpoint).device == torch.device("cpu")
    assert "device auto: cpu ($PORTATTN_DEVICE)" in caplog.text


def test_auto_dtype_reads_the_config(tmp_path):
    cuda = torch.device("cuda")
    for entry, want in [
        ({"dtype": "float16"}, torch.float16),  # transformers 5's key
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        ({"text_config": {"dtype": "bfloat16"}}, torch.bfloat16),  # a multimodal config
        ({"torch_dtype": "float32"}, torch.float32),
        ({}, torch.float32),  # names none: what transformers loads
    ]:
        (tmp_path / "config.json").write_text(json.dumps(entry))
        assert auto_dtype(str(tmp_path), cuda) == want, entry
    assert auto_dtype(str(tmp_path / "missing"), cuda) == torch.float32
    assert auto_dtype(str(tmp_path), torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("half", torch.float16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("float", torch.float32),
        ("float32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_spellings(name, dtype):
    assert EngineConfig(model="m", device="cpu", dtype=name).dtype == dtype


def test_bad_dtypes_and_budgets_name_the_flag():
    with pytest.raises(ValueError, match=r"expected dtype \(--dtype\) in \['auto', 'half', .*\], got 'fp17'"):
        EngineConfig(model="m", device="cpu", dtype="fp17")
    with pytest.raises(ValueError, match=r"expected gpu_memory_utilization \(--gpu-memory-utilization\) in \(0, 1\]"):
        EngineConfig(model="m", device="cpu", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(--max-num-batched-tokens\) to be a positive int"):
        EngineConfig(model="m", device="cpu", max_num_batched_tokens=0)


def test_chunked_prefill_size_is_the_older_name_of_the_budget():
    old = EngineConfig(model="m", device="cpu", chunked_prefill_size=96)
    new = EngineConfig(model="m", device="cpu", max_num_batched_tokens=96)
    assert old == new and new.chunked_prefill_size == 96
    assert EngineConfig(model="m", device="cpu", max_num_batched_tokens=96, chunked_prefill_size=96) == new
    with pytest.raises(ValueError, match=r"expected one token budget, got max_num_batched_tokens .* 96 and"):
        EngineConfig(model="m", device="cpu", max_num_batched_tokens=96, chunked_prefill_size=64)


def record_steps(monkeypatch) -> list[list[tuple[int, int]]]:
    """``(tokens computed before, new tokens)`` of each sequence, per forward."""
    steps, build = [], ForwardBatch.build

    def record(scheduled, *args, **kwargs):
        steps.append([(seq.num_computed, n) for seq, n in scheduled])
        return build(scheduled, *args, **kwargs)

    monkeypatch.setattr(ForwardBatch, "build", staticmethod(record))
    return steps


def test_a_long_prompt_is_prefilled_within_the_default_budget(ckpt_root, monkeypatch):
    path = checkpoint("llama", ckpt_root)
    llm = LLM(path, max_model_len=3200, allow_long_max_model_len=True, num_pages=200)
    prompt = random_prompts([3000], seed=5)[0]
    steps = record_steps(monkeypatch)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), use_tqdm=False)[0]
    assert steps == [[(0, 2048)], [(2048, 952)], [(3000, 1)]]  # without a budget: one forward of 3000
    assert len(out.token_ids) == 2


def test_decodes_come_before_prompt_chunks(ckpt_root, monkeypatch):
    """Within the budget, running decodes come first, whatever the order of the running list (it is
    admission order, where no prefilling sequence is older than a decoding one: it is reversed here
    by hand to see the rule)."""
    path = checkpoint("llama", ckpt_root)
    llm = LLM(path, page_size=4, num_pages=64, max_model_len=64, max_num_batched_tokens=11)
    engine = llm.engine
    short, long = random_prompts([3, 20], seed=9)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    b, a = engine.add_request(short, params), engine.add_request(long, params)
    steps = record_steps(monkeypatch)
    engine.step()  # b whole, a 8 of its 20 tokens
    engine.scheduler.running.reverse()  # a first: prefilling, and listed before b, which decodes
    engine.scheduler.token_budget = 4
    engine.step()
    assert steps == [[(0, 3), (0, 8)], [(3, 1), (8, 3)]]  # b's decode, then a's chunk in what is left
    while engine.has_unfinished():
        engine.step()
    assert a.output_token_ids == hf_reference(path, tuple(long), 4)[0]
    assert b.output_token_ids == hf_reference(path, tuple(short), 4)[0]


def test_auto_dtype_of_a_gguf_file_is_bfloat16_on_an_accelerator(tmp_path):
    path = str(tmp_path / "model.gguf")  # a GGUF file names no compute dtype
    assert auto_dtype(path, torch.device("cuda")) == torch.bfloat16
    assert auto_dtype(path, torch.device("cpu")) == torch.float32
