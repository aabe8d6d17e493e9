"""Tiny checkpoints of every family, the engine at TP=1 and TP=2 on them, and the check that no
rank process outlives its engine."""

from __future__ import annotations

import os

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import engine_families, image_prompts
from tiny_models import ckpt_root, one_thread, random_prompts  # noqa: F401

FAMILIES = tuple(family for family in engine_families() if family != "qwen2")  # Qwen2: Qwen2-MoE covers it
# The CPU (gloo) in CI; `PORTATTN_TEST_ENGINE_DEVICE=cuda` runs every engine here on GPUs (NCCL).
DEVICE = os.environ.get("PORTATTN_TEST_ENGINE_DEVICE", "cpu")


def prompts(family: str) -> list:
    """Prompts of lengths 1 to 30; the second Qwen2.5-VL one carries an 8x8 image (16 placeholders,
    cut by chunks of 8 tokens)."""
    ids = random_prompts([1, 5, 13, 30], seed=11, vocab=248)
    if family != "qwen2_5_vl":
        return ids
    return [ids[0], *image_prompts([ids[1]]), *ids[2:]]


def generate(llm: LLM, batch: list, max_tokens: int, prompt_logits: bool):
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True, return_prompt_logits=prompt_logits
    )
    return llm.generate(batch, params, use_tqdm=False)


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
