"""Read a server's engine-loop trace (``PORTATTN_STEP_TRACE``, written at shutdown): the loop's first steps after
the first request (where a burst's first stop was, round 38), the medians of each part, every step whose
parts took over twice their median (with the requests added before it), and (round 43) the steps far longer than
those around them with the time between them.

    python3 benchmarks/results/round39/scripts/trace_summary.py TRACE.json [--first 40] [--serve SERVE.json]

``--serve``: the serving benchmark's result of the same load (``benchmarks.serve``, which keeps the load's start on
the same clock): each moment every stream stopped (``benchmarks.serve_report.stalls``) beside the engine's loop
rows of the 100 ms before it ended, to tell a stop the engine's steps made from one the server's process made.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository's root: benchmarks.serve_report

PARTS = ("drain_ms", "step_ms", "emit_ms", "publish_ms")


def row_text(row: dict, t0: float) -> str:
    if "idle_ms" in row:
        return f"{row['t'] - t0:8.3f} s  idle {row['idle_ms']:7.1f} ms  added {row['added']}"
    parts = "  ".join(f"{p[:-3]} {row[p]:6.1f}" for p in PARTS)
    counts = f"added {row['added']:3d}  running {row['running']:3d}  waiting {row['waiting']:3d}"
    return f"{row['t'] - t0:8.3f} s  {parts}  {counts}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--first", type=int, default=40)
    parser.add_argument("--serve", help="the serving benchmark's JSON of the same load")
    args = parser.parse_args()
    with open(args.trace) as f:
        rows = json.load(f)["steps"]
    steps = [r for r in rows if "step_ms" in r]
    if not steps:
        print("no steps")
        return 1
    t0 = next((r["t"] for r in rows if r["added"]), rows[0]["t"])
    start = load_start(args.serve) if args.serve else None
    if start is not None:  # the load's own start (the first request added may be the benchmark's warm-up)
        t0 = start
        arrivals(rows, start)
    medians = {p: statistics.median(r[p] for r in steps) for p in PARTS}
    print(f"{len(steps)} steps, {sum(r['added'] for r in rows)} requests added; medians (ms): "
          + ", ".join(f"{p} {m:.2f}" for p, m in medians.items()))  # fmt: skip
    print(
        f"\nthe first {args.first} rows from {'the load' if start is not None else 'the first request'} on (t from it):"
    )
    first = [r for r in rows if r["t"] >= t0][: args.first]
    for r in first:
        print(" ", row_text(r, t0))
    slow = [r for r in steps if any(r[p] > 2 * medians[p] + 1.0 for p in PARTS)]
    print(f"\n{len(slow)} steps with a part over twice its median (+1 ms):")
    for r in slow[:60]:
        print(" ", row_text(r, t0))
    gaps = [(b["t"] - a["t"]) * 1e3 - sum(a.get(p, 0.0) for p in PARTS) - a.get("idle_ms", 0.0)
            for a, b in itertools.pairwise(rows)]  # fmt: skip
    print(f"\ntime between loop rows not in any part: total {sum(gaps):.1f} ms, largest {max(gaps, default=0):.1f} ms")
    spikes(steps, t0)
    if args.serve:
        stops_beside_steps(rows, args.serve)
    return 0


def spikes(steps: list[dict], t0: float) -> None:
    """Steps over 12 ms and over 2.5 times the median of the ten around them, and the time between groups of them
    (spikes within 0.3 s of each other grouped): a cause outside the steps' own work recurs at its own period
    (round 43: call 3 of round 42, every 1.55 s)."""
    found = []
    for i, r in enumerate(steps):
        around = [x["step_ms"] for x in steps[max(0, i - 5) : i] + steps[i + 1 : i + 6]]
        if around and r["step_ms"] > 12.0 and r["step_ms"] > 2.5 * statistics.median(around):
            found.append(r)
    print(f"\n{len(found)} steps over 12 ms and 2.5x the ten around them (t from the start above, step ms):")
    if not found:
        return
    print("  " + " ".join(f"{r['t'] - t0:.2f}:{r['step_ms']:.0f}" for r in found[:60]))
    groups = [found[0]["t"]]
    for r in found[1:]:
        if r["t"] - groups[-1] > 0.3:
            groups.append(r["t"])
    between = [b - a for a, b in itertools.pairwise(groups)]
    if between:
        print(f"  {len(groups)} groups; between them (s): " + " ".join(f"{x:.2f}" for x in between))


def load_start(serve_json: str) -> float | None:
    with open(serve_json) as f:
        return json.load(f).get("load_start_perf_counter_s")


def arrivals(rows: list[dict], start: float) -> None:
    """When the load's requests reached the engine's loop: the time each tenth of them had been added by."""
    added = [(r["t"] - start, r["added"]) for r in rows if r["added"] and r["t"] >= start]
    total = sum(n for _, n in added)
    if not total:
        return
    marks, seen, want = [], 0, 1
    for t, n in added:
        seen += n
        while want <= 10 and seen >= want * total / 10:
            marks.append(f"{want * 10}% {t * 1e3:.0f} ms")
            want += 1
    print(f"the load's {total} requests reached the engine's loop by (from the load's start): " + ", ".join(marks))


def stops_beside_steps(rows: list[dict], serve_json: str) -> None:
    from benchmarks.serve_report import stalls

    with open(serve_json) as f:
        served = json.load(f)
    start = served.get("load_start_perf_counter_s")
    if start is None:
        print(f"\n{serve_json} has no load_start_perf_counter_s (an older benchmark): no alignment")
        return
    found = stalls(served["requests"]) or []
    print(f"\n{len(found)} moments every stream stopped, each with the engine loop's rows of the 100 ms before")
    for at, extra, begun in found[:40]:
        end = start + at
        print(f"  stop ending at {at:.3f} s (+{extra * 1e3:.0f} ms, {begun} streams begun):")
        for r in rows:
            if end - 0.1 <= r["t"] <= end:
                print("    ", row_text(r, start))


if __name__ == "__main__":
    raise SystemExit(main())
