"""Programmatic dependent launch (``launch.PDL``) changes when kernels start, never what they compute:
the engine's greedy tokens and logits with it equal those without, bit for bit, in captured graphs
and eager steps (on NVIDIA GPUs of compute capability 9 and later; elsewhere the launches never take
it, which the first test checks)."""

from __future__ import annotations

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import ENGINE_DEVICE, checkpoint, random_prompts

pytest.importorskip("triton")
from portattn.kernels.triton import launch

PROMPTS = random_prompts([1, 5, 17, 30], seed=3)


def test_launches_take_pdl_only_where_switched_on_and_supported(monkeypatch):
    assert launch.PDL  # on by default
    assert launch.pdl_options(torch.device("cpu")) == {}
    if ENGINE_DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9 and torch.version.hip is None:
        assert launch.pdl_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(launch, "PDL", False)
    assert launch.pdl_options(torch.device(ENGINE_DEVICE)) == {}


@pytest.mark.skipif(
    ENGINE_DEVICE != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs an NVIDIA GPU of compute capability 9 or later "
    "(PORTATTN_TEST_ENGINE_DEVICE=cuda)",
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pdl_steps_equal_plain_steps(family, ckpt_root, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)
    outs = {}
    for pdl in (False, True):
        monkeypatch.setattr(launch, "PDL", pdl)
        for eager in (False, True):  # a fresh engine each: graphs captured with the launches' setting
            llm = LLM(
                checkpoint(family, ckpt_root), dtype="bfloat16", device="cuda", page_size=7, num_pages=64,
                max_model_len=128, max_num_seqs=4, enforce_eager=eager,
            )  # fmt: skip
            outs[pdl, eager] = llm.generate(PROMPTS, params, use_tqdm=False)
            llm.engine.shutdown()
    for eager in (False, True):
        for a, b in zip(outs[True, eager], outs[False, eager], strict=True):
            assert a.token_ids == b.token_ids
            assert torch.equal(a.logits, b.logits)
