"""The engine's API boundary refuses what would otherwise fail deep inside, or run and answer wrong:
sampling parameters, token ids, devices, pool sizes, context lengths and image inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.test_qwen2_5_vl import ONE, ONE_IMAGE, images
from portattn.engine.config import EngineConfig
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from tiny_models import checkpoint, random_prompts

PROMPT = random_prompts([7], seed=21)[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 1e-38}, r"expected temperature 0 \(greedy\) or a finite number >= 1e-05, got 1e-38"),
        ({"temperature": MIN_TEMPERATURE / 2}, "expected temperature"),
        ({"temperature": True}, "expected temperature"),
        ({"seed": 2**64}, r"expected seed to be None or an int in \[0, 2\*\*64\), got 18446744073709551616"),
        ({"seed": -1}, "expected seed"),
        ({"seed": True}, "expected seed"),
        ({"max_tokens": True}, "expected max_tokens to be an int >= 1, got True"),
        ({"top_k": True}, "expected top_k"),
        ({"top_p": True}, "expected top_p"),
        ({"ignore_eos": 1}, "expected ignore_eos to be a bool"),
    ],
)
def test_sampling_params_refuse(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(ckpt_root) -> LLM:
    return LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=16, max_model_len=64)


@pytest.mark.parametrize("bad", [True, False, 6.0, 256, -1, "6"])
def test_token_ids_are_ints_in_the_vocabulary(llm, bad):
    with pytest.raises(ValueError, match=r"expected token ids in \[0, 256\) \(ints\), got .* at index 1"):
        llm.generate([[5, bad, 7]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"expected token ids in \[0, 256\)"):
        llm.engine.add_request([5, bad, 7], SamplingParams())
    assert not llm.engine.has_unfinished()


def test_numpy_token_ids_in_a_list_are_ints(llm):
    # one new token over a 3-token prompt: no full page of 4 computed, none left in the prefix cache
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    mixed = llm.generate([[5, np.int64(6), np.int32(7)]], params, use_tqdm=False)[0]
    assert mixed.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in mixed.prompt_token_ids)
    assert mixed.outputs[0].token_ids == plain.outputs[0].token_ids
    assert not llm.engine.has_unfinished() and llm.engine.allocator.num_free == 16


def test_generate_checks_every_argument_before_queueing(llm):
    with pytest.raises(ValueError, match="expected SamplingParams, got dict"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(), {"max_tokens": 3}], use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.allocator.num_free == 16


def test_the_temperature_floor_and_the_largest_seed_sample(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=MIN_TEMPERATURE, seed=2**64 - 1)
    coldest = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert coldest.token_ids == greedy.token_ids  # near-greedy, and no NaN from the division


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "foo"}, r"expected a device such as cpu.*, got 'foo'"),
        (
            {"device": "cpu", "enable_prefix_caching": 1},
            r"expected enable_prefix_caching \(--enable-prefix-caching\) to be a bool, got 1",
        ),
    ],
)
def test_engine_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", dtype="float32", **kwargs)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch build has CUDA")
def test_a_missing_accelerator_is_refused_at_construction():
    with pytest.raises(ValueError, match="cuda is not available: this torch build has no CUDA; devices here: cpu"):
        EngineConfig(model="m", device="cuda", dtype="float32")


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_an_accelerator_index_past_the_last_device_is_refused():
    kind = torch.accelerator.current_accelerator().type
    with pytest.raises(
        ValueError, match=f"{kind}:99 is not available: there is no {kind} device 99; devices here: cpu"
    ):
        EngineConfig(model="m", device=f"{kind}:99", dtype="float32")


def test_max_num_seqs_defaults_to_what_the_pool_can_hold():
    assert EngineConfig(model="m", device="cpu", dtype="float32").max_num_seqs == 64
    assert EngineConfig(model="m", device="cpu", dtype="float32", num_pages=9).max_num_seqs == 9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # Used to cap every output at 14 tokens (finish "length") without a word.
        ({"num_pages": 1}, r"num_pages \(--num-pages\) >= 128 \(one request of max_model_len 2048 at page size 16\)"),
        ({"num_pages": 4, "page_size": 4, "max_model_len": 32}, r"expected num_pages \(--num-pages\) >= 8 .*, got 4"),
        ({"num_pages": 8, "max_model_len": 64, "max_num_seqs": 9}, r"num_pages \(--num-pages\) >= max_num_seqs 9"),
        (
            {"kv_cache_memory": 4096, "max_model_len": 64},
            r"expected the KV cache to hold at least 64 pages .* from kv_cache_memory \(--kv-cache-memory\) 4096 bytes",
        ),
        ({"num_pages": 300, "max_model_len": 4096}, "expected max_model_len <= the model's max_position_embeddings"),
    ],
)
def test_pools_and_lengths_are_checked_at_construction(kwargs, message, ckpt_root):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint("llama", ckpt_root), **kwargs)


def test_a_long_max_model_len_when_explicitly_allowed(ckpt_root):
    llm = LLM(checkpoint("llama", ckpt_root), num_pages=300, max_model_len=4096, allow_long_max_model_len=True)
    assert llm.engine.max_model_len == 4096


def test_a_pool_of_exactly_one_request_runs_it_to_max_model_len(ckpt_root):
    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=5, max_model_len=20)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 20 - len(PROMPT) and out.finish_reason == "length"


@pytest.fixture(scope="module")
def vl(ckpt_root) -> LLM:
    return LLM(checkpoint("qwen2_5_vl", ckpt_root), page_size=16, num_pages=16, max_model_len=256)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_pixels_are_refused(vl, value):
    data = images(ONE_IMAGE)
    data["pixel_values"][5, 7] = value
    with pytest.raises(ValueError, match=rf"expected finite pixel_values, got {value} at pixel_values\[5, 7\]"):
        vl.generate({"prompt_token_ids": list(ONE), "multi_modal_data": data}, use_tqdm=False)
    with pytest.raises(ValueError, match="expected finite pixel_values"):
        vl.encode_images(data["pixel_values"], data["image_grid_thw"])
    assert not vl.engine.has_unfinished()


@pytest.mark.parametrize("grid", [[[1.0, 8.0, 8.0]], [[1, 8.5, 8]], [[True, 8, 8]], [1, 8, 8]])
def test_image_grids_are_ints(vl, grid):
    data = images(ONE_IMAGE)
    with pytest.raises(ValueError, match=r"expected grid_thw\[0\] = \(t, h, w\) of positive ints"):
        vl.generate(
            {"prompt_token_ids": list(ONE), "multi_modal_data": {**data, "image_grid_thw": grid}}, use_tqdm=False
        )
    with pytest.raises(ValueError, match=r"expected grid_thw\[0\]"):
        vl.encode_images(data["pixel_values"], grid)
