"""Summarise Nsight Compute's SASS source pages (``sass_NAME.csv`` in a folder, ``ncu --page source --csv
--print-source sass``): for each kernel the warp-stall samples by region (the code after each ``USETMAXREG``, which a
warp-specialized kernel runs at its partitions' starts and ends: in the wide kernel the producer's code follows
``TRY_ALLOC ... 0x68``, the consumers' ``DEALLOC ... 0xc8``, the epilogue the last ``TRY_ALLOC``), each region's
stall reasons and opcodes, and the 25 instructions with the most samples with their two main reasons.

    python3 stalls.py FOLDER
"""

import collections
import csv
import glob
import os
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def share(counter: collections.Counter, total: float, n: int) -> str:
    return ", ".join(f"{k} {v / total:.1%}" for k, v in counter.most_common(n) if v)


for path in sorted(glob.glob(os.path.join(sys.argv[1], "sass_*.csv"))):
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "Address" in line), None)
    print(f"== {os.path.basename(path)}")
    if start is None:
        print("\n".join(lines[:5]))
        continue
    rows = list(csv.DictReader(lines[start:]))
    columns = list(rows[0].keys()) if rows else []
    samples = next((c for c in columns if "Sampling (All" in c), None)
    reasons = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]
    if samples is None:
        print("columns:", columns)
        continue
    total = sum(number(r[samples]) for r in rows) or 1.0
    region, regions = "the start", collections.defaultdict(lambda: [0.0, collections.Counter(), collections.Counter()])
    for r in rows:
        op = r["Source"].split()
        op = [w for w in op if not w.startswith("@")]
        name = op[0] if op else "?"
        if name.startswith("USETMAXREG"):
            region = f"after {r['Address']} {' '.join(op)}"
        n = number(r[samples])
        entry = regions[region]
        entry[0] += n
        entry[2][name] += n
        for c in reasons:
            entry[1][c[6:]] += number(r[c])
    print(f"samples {total:.0f}")
    for name, (n, why, ops) in regions.items():
        print(f"  {name}: {n / total:.1%} of samples; reasons: {share(why, sum(why.values()) or 1, 7)}")
        print(f"    opcodes: {share(ops, n or 1, 10)}")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:25]:
        why = collections.Counter({c[6:]: number(r[c]) for c in reasons})
        print(
            f"  {r['Address']:>16} {number(r[samples]) / total:6.1%}  {share(why, sum(why.values()) or 1, 2):<34}"
            f" {r['Source'].strip()[:80]}"
        )
