"""Tiny checkpoints of every family, the engine at TP=1 and TP=2 on them, and the check that no
rank process outlives its engine."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import engine_families, image_prompts, save_tiny_checkpoint

FAMILIES = tuple(family for family in engine_families() if family != "qwen2")  # Qwen2: Qwen2-MoE covers it
# The CPU (gloo) in CI; `PORTATTN_TEST_ENGINE_DEVICE=cuda` runs every engine here on GPUs (NCCL).
DEVICE = os.environ.get("PORTATTN_TEST_ENGINE_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Each rank process takes one of the machine's cores; the test process keeps to one as well."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@functools.cache
def checkpoint(family: str, root: str) -> str:
    return save_tiny_checkpoint(family, f"{root}/{family}")


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 248, (n,), generator=g).tolist() for n in lengths]


def prompts(family: str) -> list:
    """Prompts of lengths 1 to 30; the second Qwen2.5-VL one carries an 8x8 image (16 placeholders,
    cut by chunks of 8 tokens)."""
    ids = random_prompts([1, 5, 13, 30], seed=11)
    if family != "qwen2_5_vl":
        return ids
    return [ids[0], *image_prompts([ids[1]]), *ids[2:]]


def generate(llm: LLM, batch: list, max_tokens: int, prompt_logits: bool):
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, return_logits=True, return_prompt_logits=prompt_logits
    )
    return llm.generate(batch, params, use_tqdm=False)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max() / want.abs().max())


def rank_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.parallel.processes]


def alive(pid: int) -> bool:
    """A process of that id exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    """Ids of the live child processes of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out
