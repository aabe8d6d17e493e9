"""A step-cost model of the burst (256 prompts of 1024 tokens, 128 outputs each, all queued at once) through the
engine's own ``Scheduler``, by token budget and ``max_num_partial_prefills``, cap 128.

The cost of a step is fitted (least squares) to an engine trace that has each step's prompt tokens and decodes
(round 38's H100 burst, ``round38/gpu_run/call1/burst_warm.json``: 3.8 ms + 13.5 us a prompt token + 66 us a
decode, mean error 1.7 ms). The model has no host pauses and no HTTP: it shows what the budget and the scheduling
rule change, not the measured tails.

    python3 benchmarks/results/round41/scripts/burst_model.py [TRACE.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "round40/scripts"))
import partial_sim  # (round 40's replay of a load through the engine's scheduler)

TRACE = Path(__file__).resolve().parents[2] / "round38/gpu_run/call1/burst_warm.json"


def fit(trace: Path) -> np.ndarray:
    """(ms a step, ms a prompt token, ms a decode) from the trace's steps (those under 100 ms)."""
    steps = [s for s in json.loads(trace.read_text())["steps"] if s["ms"] < 100]
    x = np.array([[1.0, s["prompt_tokens"], s["decodes"]] for s in steps])
    y = np.array([s["ms"] for s in steps])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    print(f"fitted: {coef[0]:.2f} ms + {coef[1] * 1e3:.1f} us a prompt token + {coef[2] * 1e3:.0f} us a decode "
          f"(mean error {np.abs(x @ coef - y).mean():.2f} ms over {len(steps)} steps)")  # fmt: skip
    return coef


def simulate(coef, budget: int, partial: int, cap: int = 128, n: int = 256, prompt: int = 1024, out: int = 128):
    """(TTFT mean s, last TTFT s, ITL median ms, ITL p99 ms) of the burst on the model's clock (round 40's replay
    of a load through the scheduler, all requests at once, this model's step cost)."""
    requests = [{"start": 0.0, "input_len": prompt, "output_len": out} for _ in range(n)]

    def cost(tokens: int, decodes: int) -> float:
        return (coef[0] + coef[1] * tokens + coef[2] * decodes) / 1e3

    gaps, ttfts = partial_sim.simulate(requests, budget, cap, partial, cost)
    gaps.sort()
    return sum(ttfts) / len(ttfts), max(ttfts), gaps[len(gaps) // 2] * 1e3, gaps[int(0.99 * len(gaps))] * 1e3


def main() -> None:
    coef = fit(Path(sys.argv[1]) if len(sys.argv) > 1 else TRACE)
    print(f"{'budget':>6} {'limit':>5} {'TTFT mean':>9} {'last':>6} {'ITL median':>10} {'p99':>6} {'ratio':>5}")
    for budget in (2048, 2560, 3072, 4096):
        for partial in (0, 1):
            mean, last, med, p99 = simulate(coef, budget, partial)
            print(f"{budget:>6} {partial:>5} {mean:>8.2f}s {last:>5.2f}s {med:>8.1f}ms {p99:>5.1f} {p99 / med:>5.2f}")


if __name__ == "__main__":
    main()
