"""The plan step makes every host sync of an engine step: decode forwards of every family run under a
guard that fails on any device-to-host read (the rule a captured decode graph depends on)."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import engine_families, image_prompts, no_host_sync
from tiny_models import checkpoint, guard_decode_forwards, hf_reference, random_prompts


@pytest.mark.parametrize("family", engine_families())
def test_decode_forwards_do_not_sync(family, ckpt_root):
    path = checkpoint(family, ckpt_root)
    llm = LLM(path, page_size=4, num_pages=64, max_model_len=256)
    decodes = guard_decode_forwards(llm)
    prompts = random_prompts([5, 9], seed=3)
    inputs = image_prompts(prompts) if family == "qwen2_5_vl" else prompts
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert decodes and max(decodes) == 2  # the guarded steps were batched decodes
    if family != "qwen2_5_vl":
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_reference(path, tuple(prompt), 4)[0]


def test_the_guard_sees_a_sync():
    import torch

    with pytest.raises(AssertionError, match=r"Tensor\.item"), no_host_sync():
        torch.ones(2).sum().item()
    with pytest.raises(AssertionError, match=r"Tensor\.__bool__"), no_host_sync():
        bool(torch.ones(1) > 0)
    assert torch.ones(1).item() == 1.0  # restored afterwards
