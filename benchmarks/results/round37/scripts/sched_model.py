"""A step-cost model of issue 23 target 3's two loads (the estimates of round 37's notes; not a measurement).

Each engine step costs ``max(5.5 ms + 0.01 ms a decode, 0.0175 ms a token) + the decodes' KV bytes at 3.35 TB/s``
(128 KB a cached token, Llama-3-8B shape), fitted to round 35's H100 figures (a decode step of about 12 streams
6.1 ms, of 256 streams 18.9 ms; a mixed step of 2,048 tokens about 40 ms, of 4,096 about 80 ms). The scheduler
is the engine's: decodes first, then prompts oldest first within the token budget, each prompt's chunk capped
(``strict``: always, vLLM's rule; ``fill``: only where the capped chunks leave the step room, the engine's rule
since round 37). The asynchronous scheduling's one-step lag and the burst's stops are left out.

    python benchmarks/results/round37/scripts/sched_model.py [--per-token MS] [--machine h100|h200]

``--machine h200`` guesses the H200's decode side (weights and cache read 1.4x faster: 4.0 ms fixed, 0.008 ms a
decode, 4.8 TB/s); the compute-bound side is the H100's (the same tensor cores).
"""

from __future__ import annotations

import argparse
import random
import statistics

# (fixed ms, ms a decode, cache GB/s): the H100's fit, and the H200's guess (weights and cache read 1.4x faster)
MACHINES = {"h100": (5.5, 0.01, 3350), "h200": (4.0, 0.008, 4800)}


def step_ms(prompt_tokens: int, decodes: int, context: int, per_token: float, machine: str = "h100") -> float:
    fixed, per_decode, gb_s = MACHINES[machine]
    return max(fixed + per_decode * decodes, per_token * (prompt_tokens + decodes)) + context * 0.128 / gb_s


def run(arrivals, budget: int, cap: float, rule: str, per_token: float, machine: str = "h100", max_seqs: int = 256):
    t, i, waiting, running, ttft, itl = 0.0, 0, [], [], [], []
    arrivals = sorted(arrivals)
    while i < len(arrivals) or waiting or running:
        while i < len(arrivals) and arrivals[i][0] <= t:
            a = arrivals[i]
            waiting.append({"t0": a[0], "p": a[1], "done": 0, "out": a[2], "gen": 0, "last": 0.0})
            i += 1
        if not waiting and not running:
            t = arrivals[i][0]
            continue
        decoding = [s for s in running if s["done"] >= s["p"]]
        prompts = [s for s in running if s["done"] < s["p"]] + waiting[: max_seqs - len(running)]
        room = budget - len(decoding)
        full = sum(min(s["p"] - s["done"], cap) for s in prompts) >= room
        chosen = []
        for s in prompts:
            if room <= 0:
                break
            left = s["p"] - s["done"]
            n = left if (rule == "fill" and full and left <= room) else int(min(left, cap, room))
            chosen.append((s, n))
            room -= n
        context = sum(s["p"] + s["gen"] for s in decoding)
        t += step_ms(sum(n for _, n in chosen), len(decoding), context, per_token, machine)
        for s, n in chosen:
            if s in waiting:
                waiting.remove(s)
                running.append(s)
            s["done"] += n
            if s["done"] >= s["p"]:
                s["gen"], s["last"] = 1, t
                ttft.append(t - s["t0"])
        for s in decoding:
            s["gen"] += 1
            itl.append(t - s["last"])
            s["last"] = t
        running = [s for s in running if s["gen"] < s["out"]]
    itl.sort()
    median, p99 = itl[len(itl) // 2], itl[int(len(itl) * 0.99)]
    return statistics.mean(ttft) / 1000, median, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-token", type=float, default=0.0175, help="ms a token of a compute-bound step")
    parser.add_argument("--machine", choices=sorted(MACHINES), default="h100")
    args = parser.parse_args()
    burst = [(0.0, 1024, 128)] * 256
    rng, t, poisson = random.Random(0), 0.0, []
    for _ in range(400):
        t += rng.expovariate(16 / 1000)
        poisson.append((t, rng.randint(256, 768), 128))
    print("budget cap rule   | burst TTFT mean, ITL median / p99 (ratio) | Poisson 16: ITL median / p99 (ratio)")
    for budget in (2048, 2560, 3072):
        for cap, rule in ((float("inf"), "strict"), (128, "strict"), (128, "fill"), (256, "fill")):
            b = run(burst, budget, cap, rule, args.per_token, args.machine)
            p = run(poisson, budget, cap, rule, args.per_token, args.machine)
            label = f"{budget} {0 if cap == float('inf') else cap:>4} {rule:<6}"
            print(f"{label} | {b[0]:.2f} s, {b[1]:.1f} / {b[2]:.1f} ms ({b[2] / b[1]:.1f}x) | "
                  f"{p[1]:.1f} / {p[2]:.1f} ms ({p[2] / p[1]:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
