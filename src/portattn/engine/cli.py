"""``portattn generate``: run prompts through the engine from the command line.

Defaults come from :class:`EngineConfig` and :class:`SamplingParams`, so the flags and the Python
API cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses

from .config import EngineConfig
from .sampling_params import SamplingParams

_ENGINE_FLAGS = (
    "page_size",
    "attention_backend",
    "mm_attention_backend",
    "max_num_seqs",
    "num_pages",
    "chunked_prefill_size",
    "enable_prefix_caching",
    "max_model_len",
)
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
_TYPES = {"temperature": float, "top_p": float, "attention_backend": str, "mm_attention_backend": str}


def _add_flags(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...]) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        default = fields[name].default
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=f"(default: {default})")
        else:
            kind = _TYPES.get(name, int)
            parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or float64")
    _add_flags(parser, EngineConfig, _ENGINE_FLAGS)
    _add_flags(parser, SamplingParams, _SAMPLING_FLAGS)


def main(args: argparse.Namespace) -> int:
    from .llm import LLM

    prompts: list = list(args.prompt)
    prompts += [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_ids]
    if not prompts:
        raise SystemExit("portattn generate: expected at least one --prompt or --prompt-ids")
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, **{k: getattr(args, k) for k in _ENGINE_FLAGS})
    params = SamplingParams(**{k: getattr(args, k) for k in _SAMPLING_FLAGS})
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        shown = prompt if isinstance(prompt, str) else out.prompt_token_ids
        print(f"prompt: {shown!r}")
        print(f"output: {out.text!r}" if llm.tokenizer is not None else f"output ids: {out.token_ids}")
        print(f"  ({len(out.token_ids)} tokens, finish: {out.finish_reason})")
    return 0
