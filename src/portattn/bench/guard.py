"""Benchmark guard: ``python -m portattn.bench.guard [--baseline FILE] [--tolerance 0.10]`` (needs a GPU).

Times the guarded cases of ``paged_attention`` (ours alone, no peers) as CUDA-graph replays and
compares each median with a committed baseline: a JSON file that ``python -m portattn.bench --graph``
wrote on the same device model. A case more than ``tolerance`` slower than its baseline fails (exit
status 1). Another device model gets no verdict (exit status 0, said so), since its times are not
comparable. Graph replays make the times steady enough for this: their spread (p90 - p10 over the
median) is printed with each case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

GUARDED = (
    "decode B=64 L=4096 P=16",
    "fp8 e4m3 decode B=64 L=4096 P=16",
    "decode B=1 L=65536 P=16",
    "prefill B=1 L=8192 causal",
)
TOLERANCE = 0.10
BASELINE = Path("benchmarks/results/round10_h200/baseline.json")  # from the repository root


def baseline_times(payload: dict) -> dict[str, float]:
    """Median ms per case of a ``python -m portattn.bench --graph`` JSON (graph-timed cases only)."""
    return {c["case"]: c["portattn_ms"] for c in payload["cases"] if c.get("timing") == "graph"}


def slowdowns(measured: dict[str, float], baseline: dict[str, float], tolerance: float = TOLERANCE) -> list[str]:
    """One line per guarded case that is missing from either side or more than ``tolerance`` slower."""
    failures = []
    for case in GUARDED:
        if case not in baseline:
            failures.append(f"{case}: no graph-timed baseline")
        elif case not in measured:
            failures.append(f"{case}: not measured")
        elif measured[case] > (1 + tolerance) * baseline[case]:
            ratio = measured[case] / baseline[case]
            failures.append(f"{case}: {measured[case]:.4f} ms = {ratio:.2f}x the baseline {baseline[case]:.4f} ms")
    return failures


def measure_guarded(device: torch.device) -> dict[str, dict]:
    """Median ms and spread of each guarded case on ``device`` (graph replays)."""
    from .paged_attention import CASES, run_case

    by_name = {c.name: c for c in CASES}
    results = {}
    for name in GUARDED:
        case = dataclasses.replace(by_name[name], peers=(), torch_backend=False)
        result = run_case(case, device, graph=True)
        results[name] = {"ms": result["portattn_ms"], "spread": result["portattn_spread"]}
    return results


def check(baseline_path: Path, device: torch.device, tolerance: float = TOLERANCE) -> tuple[list[str], str]:
    """(failures, report). No failures and a report saying why when the device model differs."""
    from ..device import describe_device

    payload = json.loads(baseline_path.read_text())
    name = describe_device(device)["name"]
    if payload["meta"].get("device_name") != name:
        return [], f"baseline measured on {payload['meta'].get('device_name')}, this is {name}: no verdict"
    baseline = baseline_times(payload)
    results = measure_guarded(device)
    lines = [f"{'case':<38} {'ms':>8} {'spread':>7} {'baseline':>9} {'ratio':>6}"]
    for case, r in results.items():
        base = baseline.get(case, float("nan"))
        lines.append(f"{case:<38} {r['ms']:>8.4f} {100 * r['spread']:>6.1f}% {base:>9.4f} {r['ms'] / base:>6.2f}")
    return slowdowns({c: r["ms"] for c, r in results.items()}, baseline, tolerance), "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..device import default_device, is_gpu

    parser = argparse.ArgumentParser(prog="python -m portattn.bench.guard", description=__doc__)
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = parser.parse_args(argv)
    device = default_device()
    if not is_gpu(device):
        print(f"the guard needs a GPU (found {device})")
        return 1
    failures, report = check(args.baseline, device, args.tolerance)
    print(report)
    for line in failures:
        print("SLOWER:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
