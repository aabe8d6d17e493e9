"""Captured pieces on a GPU (``engine/piecewise.py``, ``piecewise_graphs=True``): prompt chunks and
mixed steps of up to 64 tokens replay one graph per layer boundary with attention launched between
them, against the same requests without pieces: greedy tokens equal, logits close (float32, so that
the padded steps' projections round alike). Needs ``PORTATTN_TEST_ENGINE_DEVICE=cuda``."""

from __future__ import annotations

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import ENGINE_DEVICE, checkpoint, random_prompts, rel_err

pytestmark = pytest.mark.skipif(
    ENGINE_DEVICE != "cuda" or not torch.cuda.is_available(),
    reason="captures CUDA graphs (PORTATTN_TEST_ENGINE_DEVICE=cuda)",
)

PROMPTS = random_prompts([1, 31, 32, 33, 70, 100], seed=4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_captured_pieces_equal_plain_steps(family, ckpt_root):
    path = checkpoint(family, ckpt_root)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)
    outs, engines = {}, {}
    for piecewise in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", page_size=16, max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=64, piecewise_graphs=piecewise)  # fmt: skip
        outs[piecewise] = llm.generate(PROMPTS, params, use_tqdm=False)
        engines[piecewise] = llm.engine
    pieces = engines[True].runner.piecewise
    assert engines[False].runner.piecewise is None
    assert sorted(pieces.pieces) == [32, 64] and not pieces.skipped
    num_layers = len(engines[True].runner.model.attention_specs())
    for graphs, holes, _ in pieces.pieces.values():  # one graph before each layer's attention, one after the last
        assert len(graphs) == num_layers + 1 and len(holes) == num_layers
    assert pieces.steps >= 4
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert rel_err(a.outputs[0].logits, b.outputs[0].logits) < 1e-4


def test_captured_pieces_in_bfloat16_take_the_fused_rotary_write(ckpt_root):
    """bf16, where the Triton backend fuses the rotation with the cache write (the serving path): the
    first token's logits of each request within bf16 rounding of the plain steps' (the pieces' projections
    run over the padded bucket, so their rounding may differ; wrong rows or a stale plan differ wholly)."""
    path = checkpoint("llama", ckpt_root)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, return_logits=True)
    outs = {}
    for piecewise in (False, True):
        llm = LLM(path, device="cuda", dtype="bfloat16", page_size=16, max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=64, piecewise_graphs=piecewise)  # fmt: skip
        outs[piecewise] = llm.generate(PROMPTS, params, use_tqdm=False)
        if piecewise:
            assert llm.engine.runner.piecewise.steps >= 4
    for a, b in zip(outs[True], outs[False]):
        assert rel_err(a.outputs[0].logits.float(), b.outputs[0].logits.float()) < 2e-2
