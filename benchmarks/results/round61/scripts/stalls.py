"""Warp-stall samples of an Nsight Compute source page (``ncu --import R --page source --csv --print-source sass``,
plain or gzipped): the share of samples by opcode and by stall reason, and the hottest instructions:
``python3 stalls.py FILE [TOP]``."""

import csv
import gzip
import sys
from collections import Counter


def number(text: str) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
    col = {name: i for i, name in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    total, by_op, by_reason, hottest = 0.0, Counter(), Counter(), []
    for r in data:
        s = number(r[samples])
        total += s
        words = [w for w in r[col["Source"]].split() if not w.startswith("@")]
        by_op[words[0].split(".")[0] if words else "?"] += s
        for name in reasons:
            by_reason[name] += number(r[col[name]])
        stalls = {name: r[col[name]] for name in reasons if number(r[col[name]])}
        hottest.append((s, r[col["Address"]], r[col["Source"]].strip()[:90], stalls))
    print(f"{total:.0f} samples")
    print("by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(14)))
    print("by reason:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(10)))
    for s, address, source, stalls in sorted(hottest, key=lambda h: -h[0])[:top]:
        print(f"{100 * s / total:5.1f}% {address} {source} {stalls}")


if __name__ == "__main__":
    main()
