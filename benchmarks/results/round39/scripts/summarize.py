"""Summarize round 39's call 1 (``r39c1.sh``) from its output folder: each batch size's 16-head MLA decode timings
against the bf16 cache at the same batch (the issue's target: 1.6x), the ``coalesced_io`` rows against the same
cache without it, the Nsight Compute reports' key lines and the GPU tests' last line.

    python3 benchmarks/results/round39/scripts/summarize.py OUT_DIR
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

NCU_LINES = re.compile(
    r"^\s*(Duration|Achieved Occupancy|Registers Per Thread|Issue Slots Busy|Warp Cycles Per Issued Instruction"
    r"|No Eligible|Memory Throughput|DRAM Throughput|L1/TEX Hit Rate)\b|excessive (sectors|wavefronts)"
)
TARGET = 1.6
# round 38's reader of scripts/ncu_mla.py's timing lines
_spec = importlib.util.spec_from_file_location(
    "round38_summarize", Path(__file__).resolve().parents[2] / "round38" / "scripts" / "summarize.py"
)
_round38 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_round38)


def timings(path: Path) -> list[dict]:
    """Every timing line, in order (round 38's reader), with its batch size (``B=``)."""
    return [{**row, "batch": int(re.search(r"\bB=(\d+)", row["label"]).group(1))} for row in _round38.timings(path)]


def main(out: str) -> int:
    folder = Path(out)
    rows = timings(folder / "times.txt")
    print("16-head MLA decode over 4096 keys a sequence, graph replays; x bf16: the bf16 cache at the same batch")
    print(f"{'variant':<96} {'ms':>8} {'spread':>7} {'x bf16':>7} {'x plain':>8}")
    for r in rows:
        bf16 = next((q["ms"] for q in rows if q["batch"] == r["batch"] and q["label"].startswith("bf16 ")
                     and "splits" in q["label"] and "(the plan's" in q["label"]), None)  # fmt: skip
        plain = None
        if "coalesced io" in r["label"]:
            twin = r["label"].replace(" coalesced io", "")
            plain = next((q["ms"] for q in rows if q["label"] == twin), None)
        vs_bf16 = f"{bf16 / r['ms']:.2f}" if bf16 else "-"
        vs_plain = f"{plain / r['ms']:.2f}" if plain else "-"
        print(f"{r['label']:<96} {r['ms']:>8.4f} {r['spread']:>6}% {vs_bf16:>7} {vs_plain:>8}")
    print(f"target: {TARGET}x the bf16 cache")
    for report in sorted(folder.glob("ncu_*.txt")):
        lines = [line.strip() for line in report.read_text(errors="replace").splitlines() if NCU_LINES.search(line)]
        print(f"\n== {report.stem}")
        print("\n".join(lines) if lines else "(no report lines: see the file)")
    tests = folder / "tests.txt"
    if tests.exists():
        lines = [line for line in tests.read_text().splitlines() if re.search(r"\b(passed|failed|error)", line)]
        print("\n== tests:", *(lines or ["(no summary line)"]), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
