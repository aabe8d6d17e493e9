"""Summarize round 38's call 1 (``r38c1.sh``) from its output folder: the graph-replay timings of every 16-head MLA
decode variant against the bf16 cache and against the e4m3 cache's ``fp8_mma`` default (the issue's target: 1.6x
the bf16 cache), and from each Nsight Compute report the lines that say where the time goes (duration, occupancy,
issue, each pipe's share of its peak).

    python3 benchmarks/results/round38/scripts/summarize.py OUT_DIR
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TIMING = re.compile(r"^(?P<label>.+): (?P<ms>[0-9.]+) ms \(spread (?P<spread>[0-9.]+)%\), (?P<tbs>[0-9.]+) TB/s$")
NCU_LINES = re.compile(
    r"^\s*(Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Issue Slots Busy|Executed Ipc Active"
    r"|Warp Cycles Per Issued Instruction|No Eligible|Memory Throughput|DRAM Throughput|L1/TEX Hit Rate"
    r"|sm__inst_executed_pipe_\S+|sm__pipe_\S+)\b"
)
TARGET = 1.6


def timings(path: Path) -> list[dict]:
    """Every timing line of ``times.txt``, in order (a variant timed twice appears twice)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        m = TIMING.match(line.strip())
        if m:
            rows.append({**m.groupdict(), "ms": float(m["ms"]), "tbs": float(m["tbs"])})
    return rows


def main(out: str) -> int:
    folder = Path(out)
    rows = timings(folder / "times.txt")
    bf16 = next((r["ms"] for r in rows if r["label"].startswith("bf16 ")), None)
    base = next((r["ms"] for r in rows if r["label"].startswith("e4m3 ") and "tiles 16,64,4,2" in r["label"]
                 and "alu" not in r["label"] and "ahead" not in r["label"]), None)  # fmt: skip
    print("16-head MLA decode, B=64 over 4096 keys, graph replays")
    print(f"{'variant':<80} {'ms':>8} {'spread':>7} {'TB/s':>6} {'x bf16':>7} {'x fp8_mma':>9}")
    for r in rows:
        vs_bf16 = f"{bf16 / r['ms']:.2f}" if bf16 else "-"
        vs_base = f"{base / r['ms']:.2f}" if base else "-"
        print(f"{r['label']:<80} {r['ms']:>8.4f} {r['spread']:>6}% {r['tbs']:>6.2f} {vs_bf16:>7} {vs_base:>9}")
    if bf16:
        print(f"target: {bf16 / TARGET:.4f} ms ({TARGET}x the bf16 cache's {bf16:.4f})")
    for report in sorted(folder.glob("ncu_*.txt")):
        lines = [line.strip() for line in report.read_text(errors="replace").splitlines() if NCU_LINES.match(line)]
        print(f"\n== {report.stem}")
        print("\n".join(lines) if lines else "(no report lines: see the file)")
    tests = folder / "tests_mla_gluon.txt"
    if tests.exists():
        print("\n== tests:", (tests.read_text().strip().splitlines() or ["(empty)"])[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
