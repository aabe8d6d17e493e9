"""The real model (SmolLM2-135M-Instruct) on a GPU: its answers, batch-1 decode speed and offline
throughput on the project's real-text prompts, in bf16 with captured graphs.

    python -m benchmarks.real_model --model SmolLM2-135M-Instruct.Q4_1.gguf --out real_model.json

``--model`` is a GGUF file or a checkpoint folder. The batch-1 decode speed is timed over 256
generated tokens of one prompt (EOS ignored), the weights-streaming floor beside it (the bf16 weights
read once per step at the copy bandwidth measured in the same run); the offline job is
``--requests`` chat prompts from ``benchmarks/prompts/chat.jsonl`` (repeated) with
``--output-len`` tokens each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).parent / "prompts"
# The first is a near-tie in float32 ("The" over "L", by 0.08): bf16 answers it either way.
QUESTIONS = [
    "What is the capital of France?",
    "What is the chemical symbol for gold?",
    "What is the largest ocean on Earth?",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    rows = [json.loads(line)["prompt"] for line in (PROMPTS / "chat.jsonl").read_text().splitlines()]
    ids = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for r in rows
    ]
    return [ids[i % len(ids)] for i in range(count)]


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from portattn.bench.ceilings import measure_ceilings
    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams

    result: dict = {"model": str(args.model), "dtype": args.dtype}
    start = time.perf_counter()
    llm = LLM(args.model, device="cuda", dtype=args.dtype, max_model_len=2048, max_num_seqs=256)
    result["construct_s"] = time.perf_counter() - start
    tokenizer = llm.tokenizer

    greedy = SamplingParams(temperature=0, max_tokens=48)
    answers = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy, use_tqdm=False)
    result["answers"] = {q: a.outputs[0].text for q, a in zip(QUESTIONS, answers)}

    prompt = chat_prompts(tokenizer, 1)
    decode = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompt, decode, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    best = min(times)
    copy_tb_s = measure_ceilings(torch.device("cuda")).copy_tb_s
    floor_ms = weight_bytes(llm.engine.model) / (copy_tb_s * 1e12) * 1e3
    result["batch1"] = {
        "tok_per_s": 256 / best,
        "step_ms": best / 256 * 1e3,
        "weights_floor_ms": floor_ms,
        "copy_tb_s": copy_tb_s,
        "x_floor": best / 256 * 1e3 / floor_ms,
    }

    prompts = chat_prompts(tokenizer, args.requests)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result["offline"] = {
        "requests": args.requests,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "seconds": elapsed,
        "output_tok_per_s": n_out / elapsed,
        "total_tok_per_s": (n_in + n_out) / elapsed,
    }
    llm.engine.shutdown()
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
