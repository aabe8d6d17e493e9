"""Helpers shared by the model, engine, server and tensor-parallel tests: the tiny checkpoints of
:mod:`portattn.testing` saved once per session, transformers' outputs the engine must reproduce,
random prompts, and the fixtures every engine test uses (``one_thread``, ``ckpt_root``).

Importable as ``tiny_models`` (pytest puts ``tests/`` on ``sys.path``); the conftests of those
folders re-export the fixtures."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import pytest
import torch

from portattn.testing import (
    engine_families,
    no_host_sync,
    save_tiny_checkpoint,
    transformers_generate,
    transformers_model,
)

# Where the parity tests run the engine (transformers' reference stays on the CPU, in float32):
# the CPU in CI; `PORTATTN_TEST_ENGINE_DEVICE=cuda` runs them with the GPU's default backend.
ENGINE_DEVICE = os.environ.get("PORTATTN_TEST_ENGINE_DEVICE", "cpu")
# The families models/test_parity.py runs through the shared matrix: every registered family but
# DeepSeek V3 (its variants and page 64) and Qwen2.5-VL (image prompts), whose modules run their own.
PARITY_FAMILIES = tuple(f for f in engine_families() if f not in ("deepseek_v3", "qwen2_5_vl"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run thousands of small ops: with two xdist workers on two cores, intra-op threads
    only spin against each other (10x slower on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def checkpoint(family: str, root: str) -> str:
    return save_tiny_checkpoint(family, f"{root}/{family}")


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@functools.cache
def hf_model(path: str):
    return transformers_model(path)


@functools.cache
def hf_reference(path: str, prompt: tuple[int, ...], max_new_tokens: int):
    """``(greedy tokens, logits of each generated token [N, V], prompt logits [n, V])`` from transformers."""
    return transformers_generate(hf_model(path), list(prompt), max_new_tokens)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max() / want.abs().max())


def worst_error_against_transformers(
    llm, path: str, prompts: list[list[int]], max_new: int, prompt_logits: bool
) -> float:
    """Generate greedily; assert the tokens equal transformers'; return the worst logit relative error."""
    from portattn.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=max_new, ignore_eos=True, return_logits=True, return_prompt_logits=prompt_logits
    )
    worst = 0.0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens, logits, ref_prompt_logits = hf_reference(path, tuple(prompt), max_new)
        assert out.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        worst = max(worst, rel_err(out.logits, logits))
        if prompt_logits:
            worst = max(worst, rel_err(out.prompt_logits, ref_prompt_logits))
    return worst


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn uniformly below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def guard_decode_forwards(llm) -> list[int]:
    """Run every decode forward of ``llm``'s model (``max_seqlen_q == 1``) under :func:`no_host_sync`;
    prefills may sync (MoE expert counts). Returns the list each guarded forward appends its number of
    sequences to (so that a test can check that batched decodes were guarded)."""
    model = llm.engine.model
    forward, decodes = model.forward, []

    def guarded(input_ids, positions, ctx):
        if ctx.metadata.max_seqlen_q != 1:
            return forward(input_ids, positions, ctx)
        decodes.append(len(ctx.metadata.q_lens))
        with no_host_sync():
            return forward(input_ids, positions, ctx)

    model.forward = guarded
    return decodes


@contextlib.contextmanager
def scheduled_token_counts() -> Iterator[list[int]]:
    """While inside: the tokens each sequence computes in every step that plans through
    ``ForwardBatch.build`` (eager and pieced steps; a captured decode step writes its own inputs), appended
    to the list yielded."""
    from portattn.engine.forward_batch import ForwardBatch

    counts: list[int] = []
    build = ForwardBatch.build

    def record(scheduled, *args, **kwargs):
        counts.extend(n for _, n in scheduled)
        return build(scheduled, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ForwardBatch, "build", staticmethod(record))
        yield counts
