"""A step-cost model of the Poisson load's inter-token gaps with and without ``max_num_partial_prefills``.

Replays a serving result's requests (arrival times, prompt and output lengths; round 38's H100 Poisson 16 at
budget 2048, cap 128) through the engine's own ``Scheduler`` on a simulated clock: a step takes ``BASE`` plus
``PER_CHUNK`` for every 128 prompt tokens in it (the medians of round 38's gaps by prompts prefilling: 6.1 ms
with none, 6.8 with one, 7.6 with two, 8.5 with three, 9.6 with four). The model has no tails of its own (host
pauses, first uses of a shape): it shows what the scheduling rule changes, not the measured p99.

    python3 benchmarks/results/round40/scripts/partial_sim.py SERVE.json [--cap 128] [--budget 2048]
"""

from __future__ import annotations

import argparse
import json

from portattn.engine.page_manager import PageManager
from portattn.engine.req_pool import ReqToTokenPool
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.scheduler import Scheduler
from portattn.engine.sequence import Sequence
from portattn.paging import PageAllocator

BASE, PER_CHUNK = 6.1e-3, 0.8e-3


def step_cost(prompt_tokens: int, decodes: int) -> float:
    """Seconds a step takes in this model: ``BASE`` plus ``PER_CHUNK`` for every 128 prompt tokens."""
    return BASE + PER_CHUNK * prompt_tokens / 128


def simulate(requests: list[dict], budget: int, cap: int, partial: int, cost=step_cost):
    """Every inter-token gap and every TTFT (seconds) of ``requests`` replayed through the scheduler, a step taking
    ``cost(prompt tokens, decodes)`` seconds."""
    longest = max(r["input_len"] + r["output_len"] for r in requests)
    pool = ReqToTokenPool(256, max(1024, longest + 16), 16, "cpu")
    pages = max(8192, sum(r["input_len"] + r["output_len"] + 15 for r in requests) // 16)
    scheduler = Scheduler(PageManager(PageAllocator(pages), pool, False), 256, budget, cap, partial)
    order = sorted(range(len(requests)), key=lambda i: requests[i]["start"])
    seqs, last, gaps, ttfts, now, k = {}, {}, [], [], 0.0, 0
    while k < len(order) or scheduler.has_unfinished():
        while k < len(order) and requests[order[k]]["start"] <= now:
            r = requests[order[k]]
            seq = Sequence(order[k], [1 + order[k] % 7] * r["input_len"], SamplingParams(max_tokens=r["output_len"]))
            seqs[seq] = r
            scheduler.add(seq)
            k += 1
        if not scheduler.has_unfinished():
            now = requests[order[k]]["start"]
            continue
        step = scheduler.schedule()
        prompt_tokens = sum(n for s, n in step if s.num_tokens - s.num_computed > 1)
        now += cost(prompt_tokens, sum(1 for s, n in step if s.num_tokens - s.num_computed == 1))
        for seq, n in step:
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                continue
            if seq in last:
                gaps.append(now - last[seq])
            else:
                ttfts.append(now - seqs[seq]["start"])
            last[seq] = now
            if seq.num_tokens - len(seq.prompt_token_ids) + 1 >= seqs[seq]["output_len"]:
                scheduler.finish(seq, "length")
            else:
                seq.token_ids.append(7)
    return gaps, ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("serve_json")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--cap", type=int, default=128)
    args = parser.parse_args()
    with open(args.serve_json) as f:
        requests = json.load(f)["requests"]
    print(f"{'max_num_partial_prefills':>24} {'ITL median':>10} {'p90':>6} {'p99':>6} {'p99/med':>7} {'TTFT mean':>9}")
    for partial in (0, 1, 2):
        gaps, ttfts = simulate(requests, args.budget, args.cap, partial)
        gaps.sort()
        med, p90, p99 = (gaps[int(q * len(gaps))] * 1e3 for q in (0.5, 0.9, 0.99))
        ttft = sum(ttfts) / len(ttfts) * 1e3
        print(f"{partial:>24} {med:>10.2f} {p90:>6.2f} {p99:>6.2f} {p99 / med:>7.2f} {ttft:>9.1f}")


if __name__ == "__main__":
    main()
