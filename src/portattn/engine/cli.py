"""``portattn generate``: run prompts through the engine from the command line.

Every field of :class:`EngineConfig` and of :class:`SamplingParams` is a flag, generated from the
dataclasses (:mod:`.arguments`): names, types, help and defaults cannot drift from the Python API.
"""

from __future__ import annotations

import argparse

from . import arguments
from .config import EngineConfig
from .sampling_params import SamplingParams

# What the command does not print, and what a flag cannot spell (lists, callables), has no flag.
# SamplingParams.seed neither: --seed is the engine's (LLM(seed=...)), the seed of every request that
# has none, which for one command is the same thing.
NOT_FLAGS = (
    "return_logits",
    "return_prompt_logits",
    "logprobs",
    "prompt_logprobs",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "seed",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    arguments.add_flags(parser.add_argument_group("engine (portattn.LLM keywords)"), EngineConfig)
    arguments.add_flags(parser.add_argument_group("sampling (SamplingParams)"), SamplingParams, exclude=NOT_FLAGS)


def main(args: argparse.Namespace) -> int:
    from ..extras import require_extra

    require_extra("engine", "portattn generate")
    from .llm import LLM

    prompts: list = list(args.prompt)
    for ids in args.prompt_ids:
        try:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        except ValueError:
            raise ValueError(f"expected --prompt-ids as comma-separated ints, got {ids!r}") from None
    if not prompts:
        raise ValueError("expected at least one --prompt or --prompt-ids, got none")
    llm = LLM(**arguments.given(args, EngineConfig))
    params = SamplingParams(**arguments.given(args, SamplingParams))
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        shown = prompt if isinstance(prompt, str) else out.prompt_token_ids
        print(f"prompt: {shown!r}")
        for c in out.outputs:
            print(f"output: {c.text!r}" if llm.tokenizer is not None else f"output ids: {c.token_ids}")
            print(f"  ({len(c.token_ids)} tokens, finish: {c.finish_reason})")
    return 0
