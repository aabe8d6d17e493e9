"""Short shapes (``engine/graphs.py``): a captured step whose sequences all hold at most ``short_keys``
keys runs the backend's plan for that many keys (for the Triton backend: short key ranges, here of 8
keys so that the test's short sequences split), and gives the tokens and logits of the long plan; a
sequence that grows past the bound moves its step back to the long shape. On the CPU the static path
runs the same plans eagerly (Triton under its interpreter), on a GPU captured graphs; NaN fills every
cache slot no sequence wrote."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS
from portattn.engine import graphs as graphs_module
from portattn.engine.graphs import SHORT
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import ENGINE_DEVICE, checkpoint, random_prompts

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

PROMPTS = random_prompts([5, 14, 3], seed=8)  # the 14-token prompt's sequence passes 24 keys at its 11th token


def run(path: str, short_keys: int, monkeypatch) -> tuple[list, list, dict]:
    """Outputs of greedy decodes with ``short_keys`` (0: no short shapes), the shapes stepped, and
    each planned shape's split count."""
    monkeypatch.setattr(graphs_module, "SHORT_KEYS", short_keys)
    from portattn.kernels.triton import launch

    monkeypatch.setattr(launch, "SHORT_SPLIT_KEYS", 8)
    # The long plan of a decode of four sequences of 4 heads in 8 key ranges (launch.FEW_DECODE_SPLITS: still
    # few), not the default target's 64: under the interpreter every range of every KV head is a program run
    # on its own, 512 a layer at each step of the long plan with 64.
    monkeypatch.setattr(launch, "DECODE_SPLIT_TARGET_WORK", 128)
    llm = LLM(
        path, device=ENGINE_DEVICE, dtype="float32", attention_backend="triton", page_size=7,
        num_pages=-(-1200 // 7), max_model_len=1100, max_num_seqs=4,
        enforce_eager=ENGINE_DEVICE == "cpu",  # graphs captured on a GPU
    )  # fmt: skip
    graphs = llm.engine.runner.graphs
    if graphs is None:  # the CPU: the static path without capture, as test_graphs.py runs it
        graphs = llm.engine.runner.enable_graphs((1, 2, 4), capture=False)
        graphs.capture_all()
    for t in (*llm.engine.kv_pool.k, *llm.engine.kv_pool.v):
        t.fill_(float("nan"))
    shapes, run_model = [], graphs._run_model

    def counted(shape, num_seqs):
        shapes.append(shape)
        return run_model(shape, num_seqs)

    monkeypatch.setattr(graphs, "_run_model", counted)
    # 13 tokens: the 14-token prompt's last two decodes attend more than 24 keys
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, return_logits=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return outs, shapes, {shape: ctx.metadata.num_kv_splits for shape, ctx in graphs.contexts.items()}


def test_short_shapes_equal_the_long_plan_and_give_way_past_the_bound(ckpt_root, monkeypatch):
    path = checkpoint("llama", ckpt_root)
    short, shapes, splits = run(path, 24, monkeypatch)
    assert (4, 1, SHORT) in shapes and (4, 1) in shapes  # short while every sequence holds <= 24 keys
    assert shapes.index((4, 1)) > max(i for i, s in enumerate(shapes) if s == (4, 1, SHORT))
    # 24 keys in 8-key ranges; 1100 keys of four sequences (few: launch.FEW_DECODE_SPLITS) in 8 ranges of 137 or more
    assert splits[(4, 1, SHORT)] == 3 and splits[(4, 1)] == 8
    long, shapes, splits = run(path, 0, monkeypatch)
    assert shapes and all(len(s) == 2 for s in shapes) and not any(len(s) == 3 for s in splits)
    for a, b in zip(short, long):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
