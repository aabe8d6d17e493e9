"""Speculative decoding on the real model: ``python -m benchmarks.spec_decode --model M [--draft-model D] --out F``.

For each prompt set (``benchmarks/prompts/repetitive.jsonl``: rewrites, summaries and code edits, whose
answers repeat their input; ``chat.jsonl``: free chat) and each batch size (``--batch-sizes``, 1 and
64), the chat prompts are answered greedily (``--output-len`` tokens at most, stopping at the end of
the answer) plainly, with n-gram speculation, and with a draft model when ``--draft-model`` is given.
The engines are built side by side and take turns: each (set, batch size) is warmed once per
configuration, then timed in ``--repeats`` rounds of every configuration in turn. Each run reports the
median output tokens per second of the whole batch (wall time of ``generate``), the acceptance rate
and the mean tokens a sequence gains per verification (from ``LLM.get_metrics()``), the speedup over
the plain run of the same set and batch size, and how many answers equal the plain ones (in 16-bit, a
verification forward of k + 1 tokens may round a near tie the other way; in float32 all of them do).

Batch 1 answers ``--prompts-per-set`` prompts one after another; batch B answers B prompts at once
(the set repeated as needed). ``--model`` and ``--draft-model`` are checkpoint folders or GGUF files.
The result is one JSON file (``--out``) and a table on standard output.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from . import prompt_sets


def counters(llm) -> dict[str, int]:
    """Speculative decoding's counters now (0 without speculation)."""
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    metrics = {m.name: m for m in llm.get_metrics()}
    return {n: metrics[f"portattn:spec_decode_{n}"].value if llm.engine.speculator is not None else 0 for n in names}


def synchronize(device) -> None:
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


def run(llm, conversations: list, batch_size: int, params) -> dict:
    """Answer ``conversations`` ``batch_size`` at a time; tokens, seconds and the answers."""
    before = counters(llm)
    synchronize(llm.config.device)
    start = time.perf_counter()
    answers = []
    for i in range(0, len(conversations), batch_size):
        outs = llm.chat(conversations[i : i + batch_size], params, use_tqdm=False)
        answers += [o.outputs[0].token_ids for o in outs]
    synchronize(llm.config.device)
    seconds = time.perf_counter() - start
    after = counters(llm)
    delta = {k: after[k] - before[k] for k in after}
    tokens = sum(map(len, answers))
    out = {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if delta["num_draft_tokens"]:
        out["acceptance_rate"] = delta["num_accepted_tokens"] / delta["num_draft_tokens"]
        out["accepted_per_verification"] = delta["num_accepted_tokens"] / delta["num_drafts"]
    return out | {"answers": answers}


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s among repeats (answers dropped), with every repeat's tokens/s."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    out = {k: v for k, v in ordered[len(ordered) // 2].items() if k != "answers"}
    return out | {"tokens_per_s_repeats": [round(r["tokens_per_s"], 1) for r in runs]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint folder or GGUF file")
    parser.add_argument("--draft-model", default=None, help="a draft checkpoint with the model's vocabulary")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--draft-tokens", type=int, default=None, help="k of the draft model (default: as n-gram)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--sets", nargs="+", default=list(prompt_sets.SETS), choices=prompt_sets.SETS)
    parser.add_argument("--prompts-per-set", type=int, default=8, help="prompts answered one by one at batch 1")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--disable-by-batch-size",
        type=lambda v: None if v == "none" else int(v),
        default=...,  # the config's default
        help="speculation pauses above this many running sequences; 'none': never (default: the config's, 8)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (the median is reported)")
    parser.add_argument("--kv-cache-memory", default="4GiB", help="of each engine (they are built side by side)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams

    k = args.num_speculative_tokens
    configs = {
        "plain": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        },
    }
    if args.draft_model is not None:
        configs["draft"] = {"model": args.draft_model, "num_speculative_tokens": args.draft_tokens or k}
    for spec in configs.values():
        if spec is not None and args.disable_by_batch_size is not ...:
            spec["disable_by_batch_size"] = args.disable_by_batch_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    prompts = {name: prompt_sets.read(name) for name in args.sets}
    result: dict = {
        "model": str(args.model),
        "draft_model": args.draft_model,
        "configs": configs,
        "output_len": args.output_len,
        "runs": [],
    }
    # Every engine is built first and the configurations take turns on each (set, batch size), so
    # that a slower phase of the machine (clocks, the host) does not fall on one configuration.
    llms = {}
    for config, spec in configs.items():
        llms[config] = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.batch_sizes),
            kv_cache_memory=args.kv_cache_memory,
            speculative_config=spec,
        )
        if spec is not None:  # as the engine took it, defaults included
            result["configs"][config] = llms[config].engine.speculator.config.as_dict()
    llm = llms["plain"]
    result |= {"device": str(llm.config.device), "dtype": str(llm.config.dtype).removeprefix("torch.")}
    result["repeats"] = args.repeats
    for name, texts in prompts.items():
        for batch_size in args.batch_sizes:
            count = args.prompts_per_set if batch_size == 1 else batch_size
            conversations = [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(count)]
            for llm in llms.values():
                # Kernels compiled and graphs warm for every length the run reaches (a longer context
                # may take another split count of the attention kernel, compiled on first use).
                llm.chat(conversations[:batch_size], params, use_tqdm=False)
            rounds = {config: [] for config in llms}
            for _ in range(args.repeats):
                for config, llm in llms.items():
                    rounds[config].append(run(llm, conversations, batch_size, params))
            for config, runs in rounds.items():
                out = median_run(runs)
                if config != "plain":
                    plain = rounds["plain"][0]["answers"]
                    out["same_as_plain"] = sum(a == b for a, b in zip(runs[0]["answers"], plain))
                out |= {"config": config, "set": name, "batch_size": batch_size, "prompts": count}
                result["runs"].append(out)
    for llm in llms.values():
        llm.shutdown()
    del llm, llms
    gc.collect()
    plain = {(r["set"], r["batch_size"]): r["tokens_per_s"] for r in result["runs"] if r["config"] == "plain"}
    for r in result["runs"]:
        r["speedup"] = r["tokens_per_s"] / plain[(r["set"], r["batch_size"])]
    print(f"{'set':<11} {'batch':>5} {'config':<6} {'tok/s':>9} {'speedup':>7} {'accept':>6} {'same':>6}")
    for r in result["runs"]:
        accept = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
        same = f"{r['same_as_plain']}/{r['prompts']}" if "same_as_plain" in r else "-"
        print(
            f"{r['set']:<11} {r['batch_size']:>5} {r['config']:<6} {r['tokens_per_s']:>9.1f} "
            f"{r['speedup']:>7.2f} {accept:>6} {same:>6}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
