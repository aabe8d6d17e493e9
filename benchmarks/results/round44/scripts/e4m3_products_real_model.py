"""The e4m3-products arithmetic on the real model: SmolLM2-135M-Instruct (float32, the CPU, the torch backend)
with an e4m3 KV cache, its attention computed as the 128-head MLA kernel's ``fp8_products`` form computes it.

That form (``benchmarks/results/round43/fp8_products_pipelined.patch``) rounds each head's query row to e4m3
after scaling it by the power of two that puts its largest magnitude in (224, 448], and the probabilities, times
2^8 relative to the row's maximum, to e4m3, the softmax's sum taken over them as rounded. Here the torch
backend's ``attend`` and ``masked_softmax`` do the same (the row's final maximum stands in for the kernel's
running one: the weights of earlier tiles are then smaller, so rounded no better than in the kernel), in every
attention of the model, the prompt's chunks included, so it is harsher than a decode-only kernel would be.
SmolLM2 is not an MLA model (9 query heads of 64 dims over 3 KV heads); what it shows is what these roundings do
to a trained model's attention, beside what the e4m3 cache alone does.

Measured per form: the mean negative log-likelihood of ``portattn.testing.PARAGRAPH`` and of the six passages of
``benchmarks/prompts/repetitive.jsonl``, each scored from the engine's prompt log-probabilities with the prompt
prefilled in chunks of 32 (so that later chunks read earlier keys back from the cache), and greedy answers to 16
chat prompts (48 new tokens each): the positions equal to the default form's answers (e4m3 cache, exact products).

    PYTHONPATH=src python benchmarks/results/round44/scripts/e4m3_products_real_model.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import time

import torch

from benchmarks import prompt_sets
from portattn.backends import torch_ref
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import PARAGRAPH, smollm2_gguf

CHUNK, MAX_NEW, CHATS = 32, 48, 16


def e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row (last dim) times the power of two that puts its largest magnitude in (224, 448], rounded to e4m3,
    scaled back."""
    amax = x.abs().amax(-1, keepdim=True)
    factor = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(448.0 / amax.clamp_min(1e-30)))), 1.0)
    return ((x * factor).to(torch.float8_e4m3fn).to(x.dtype) / factor).to(x.dtype)


def softmax_e4m3(scores, mask, sinks=None, *, empty_rows=True, return_lse=False):
    """``torch_ref.masked_softmax`` with the weights (times 2^8, relative to the row's maximum) rounded to e4m3 and
    normalized by their own sum."""
    if sinks is not None or return_lse:
        raise NotImplementedError("the emulation covers the real model's attention only (no sinks, no LSE)")
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isfinite(row_max), row_max, 0.0))
    weights = (weights * 256.0).to(torch.float8_e4m3fn).to(scores.dtype)
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(1e-30), 0.0)


@contextlib.contextmanager
def emulated(queries: bool, probabilities: bool):
    attend, softmax = torch_ref.attend, torch_ref.masked_softmax
    if queries:
        torch_ref.attend = lambda q, *args, **kwargs: attend(e4m3_rows(q), *args, **kwargs)
    if probabilities:
        torch_ref.masked_softmax = softmax_e4m3
    try:
        yield
    finally:
        torch_ref.attend, torch_ref.masked_softmax = attend, softmax


def scored(llm: LLM, ids: list[int]) -> tuple[float, list[int]]:
    """The mean negative log-likelihood of ``ids[1:]`` from the engine's prompt log-probabilities, and the likeliest
    token at each of those positions."""
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    positions = out.prompt_logprobs[1:]
    nll = -sum(position[token].logprob for position, token in zip(positions, ids[1:])) / len(positions)
    top = [next(t for t, lp in position.items() if lp.rank == 1) for position in positions]
    return nll, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="the results as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    path = smollm2_gguf()
    options = dict(page_size=16, max_model_len=1024, num_pages=256, enable_prefix_caching=False,
                   chunked_prefill_size=CHUNK)  # fmt: skip
    engines = {name: LLM(path, kv_cache_dtype=dtype, **options) for name, dtype in
               (("float32 cache", "auto"), ("e4m3 cache", "fp8_e4m3"))}  # fmt: skip
    tokenizer = engines["e4m3 cache"].processor
    texts = [PARAGRAPH] + [p.split("\n\n", 1)[1] for p in prompt_sets.read("repetitive")[::5]]
    text_ids = [tokenizer.tokenize(t) for t in texts]
    chats = [tokenizer.chat([{"role": "user", "content": q}])[1] for q in prompt_sets.read("chat")[:CHATS]]
    forms = [  # (name, engine, e4m3 queries, e4m3 probabilities)
        ("float32 cache", "float32 cache", False, False),
        ("e4m3 cache (exact products)", "e4m3 cache", False, False),
        ("e4m3 cache, e4m3 queries", "e4m3 cache", True, False),
        ("e4m3 cache, e4m3 probabilities", "e4m3 cache", False, True),
        ("e4m3 cache, e4m3 products (both)", "e4m3 cache", True, True),
        ("float32 cache, e4m3 products (both)", "float32 cache", True, True),
    ]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    results, answers, tops = [], {}, {}
    print(f"{len(texts)} texts ({sum(len(t) for t in text_ids)} tokens), {CHATS} chat prompts x {MAX_NEW} tokens")
    for name, engine, queries, probabilities in forms:
        start = time.perf_counter()
        with emulated(queries, probabilities):
            nll, tops[name] = zip(*(scored(engines[engine], ids) for ids in text_ids))
            outs = engines[engine].generate(chats, greedy, use_tqdm=False)
        answers[name] = [list(o.outputs[0].token_ids) for o in outs]
        tokens = [len(ids) - 1 for ids in text_ids]
        mean = sum(n * t for n, t in zip(nll, tokens)) / sum(tokens)
        results.append({"form": name, "nll_paragraph": nll[0], "nll_passages": list(nll[1:]), "nll_mean": mean,
                        "seconds": time.perf_counter() - start})  # fmt: skip
    ref, cache = results[0], results[1]  # the float32 cache, the e4m3 cache with exact products
    ref_top = [t for text in tops[ref["form"]] for t in text]
    print("| form | paragraph NLL | all texts NLL | perplexity x the float32 cache's | x the e4m3 cache's "
          "| top-1 as the float32 cache's | greedy answers as the float32 cache's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        same = [len(list(itertools.takewhile(lambda ab: ab[0] == ab[1], zip(a, b))))
                for a, b in zip(answers[r["form"]], answers[ref["form"]])]  # fmt: skip
        equal = sum(a == b for a, b in zip(answers[r["form"]], answers[ref["form"]]))
        top = [t for text in tops[r["form"]] for t in text]
        r["top1_agreement"] = sum(a == b for a, b in zip(top, ref_top)) / len(ref_top)
        r["greedy_answers_equal"], r["greedy_prefix_equal"] = equal, same
        r["answers"] = [tokenizer.tokenizer.decode(a) for a in answers[r["form"]]]
        print(
            f"| {r['form']} | {r['nll_paragraph']:.4f} | {r['nll_mean']:.4f} | "
            f"x{math.exp(r['nll_mean'] - ref['nll_mean']):.4f} | "
            f"x{math.exp(r['nll_mean'] - cache['nll_mean']):.4f} | "
            f"{100 * r['top1_agreement']:.1f}% | {equal} of {CHATS} (first {sum(same) / len(same):.1f} tokens) |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"texts_tokens": [len(t) for t in text_ids], "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
