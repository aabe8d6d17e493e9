"""Read a server's engine-loop trace (``PORTATTN_STEP_TRACE``, written at shutdown): the loop's first steps after
the first request (where a burst's first stop was, round 38), the medians of each part, and every step whose
parts took over twice their median (with the requests added before it).

    python3 benchmarks/results/round39/scripts/trace_summary.py TRACE.json [--first 40]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

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
    args = parser.parse_args()
    with open(args.trace) as f:
        rows = json.load(f)["steps"]
    steps = [r for r in rows if "step_ms" in r]
    if not steps:
        print("no steps")
        return 1
    t0 = next((r["t"] for r in rows if r["added"]), rows[0]["t"])
    medians = {p: statistics.median(r[p] for r in steps) for p in PARTS}
    print(f"{len(steps)} steps, {sum(r['added'] for r in rows)} requests added; medians (ms): "
          + ", ".join(f"{p} {m:.2f}" for p, m in medians.items()))  # fmt: skip
    print(f"\nthe first {args.first} rows from the first request on (t from it):")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
