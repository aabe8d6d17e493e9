"""The real model with fp8 linears on a GPU, its fp8 matmul with and without fast accumulation (round 44's
``fp8_fast_accum.patch`` applied): the mean negative log-likelihood of the Austen paragraph and the six passages of
``benchmarks/prompts/repetitive.jsonl`` joined into one prompt (about 880 tokens, prefilled in one step, so every
projection has more than 128 rows), beside the unquantized engine's. bfloat16, SmolLM2-135M-Instruct from its GGUF.

    PYTHONPATH=src python benchmarks/results/round44/scripts/fast_accum_real_model.py FILE.gguf
"""

from __future__ import annotations

import math
import sys

from benchmarks import prompt_sets
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.models.layers import fp8_linear
from portattn.testing import PARAGRAPH


def mean_nll(llm: LLM, ids: list[int]) -> float:
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    scored = out.prompt_logprobs[1:]
    return -sum(position[token].logprob for position, token in zip(scored, ids[1:])) / len(scored)


def main() -> None:
    path = sys.argv[1]
    if not hasattr(fp8_linear, "FAST_ACCUM_ABOVE_ROWS"):
        raise SystemExit("expected round 44's fp8_fast_accum.patch applied")
    options = dict(
        device="cuda", dtype="bfloat16", max_model_len=2048, chunked_prefill_size=2048, gpu_memory_utilization=0.3
    )
    text = " ".join([PARAGRAPH] + [p.split("\n\n", 1)[1] for p in prompt_sets.read("repetitive")[::5]])
    plain = LLM(path, **options)
    ids = plain.processor.tokenize(text)
    base = mean_nll(plain, ids)
    del plain
    fp8 = LLM(path, quantization="fp8", **options)
    print(f"{len(ids)} tokens in one prompt; bf16 engine NLL {base:.4f}")
    for rows, name in ((10**9, "fp8 linears"), (128, "fp8 linears, fast accumulation above 128 rows")):
        fp8_linear.FAST_ACCUM_ABOVE_ROWS = rows
        nll = mean_nll(fp8, ids)
        print(f"{name}: NLL {nll:.4f}, perplexity x{math.exp(nll - base):.4f} the bf16 engine's")


if __name__ == "__main__":
    main()
