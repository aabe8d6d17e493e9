"""Warp-stall samples of an Nsight Compute SASS export (``ncu --page source --csv --print-source sass``), by region
(the code between two ``USETMAXREG``: a partition's) and by instruction: ``python3 stalls.py SASS_CSV [TOP]``."""

import collections
import csv
import sys

with open(sys.argv[1]) as f:
    rows = list(csv.reader(f))
head = rows[1]
col = {name: i for i, name in enumerate(head)}
stalls = [n for n in head if n.startswith("stall_") and "Not Issued" not in n]
body = [r for r in rows[2:] if len(r) == len(head) and r[col["Address"]].startswith("0x")]


def num(r, name):
    try:
        return float(r[col[name]] or 0)
    except ValueError:
        return 0.0


regions, region = [], 0
for r in body:
    if "USETMAXREG" in r[col["Source"]]:
        region += 1
    regions.append(region)
total = sum(num(r, "Warp Stall Sampling (All Samples)") for r in body)
print(f"samples {total:.0f}")
by_region = collections.defaultdict(collections.Counter)
for r, g in zip(body, regions):
    by_region[g]["samples"] += num(r, "Warp Stall Sampling (All Samples)")
    by_region[g]["executed"] += num(r, "Instructions Executed")
    by_region[g]["smem_wavefronts"] += num(r, "L1 Wavefronts Shared")
    by_region[g]["smem_excess"] += num(r, "L1 Wavefronts Shared Excessive")
    for s in stalls:
        by_region[g][s] += num(r, s)
for g, c in sorted(by_region.items()):
    if c["samples"] < 0.01 * total:
        continue
    top = sorted(((c[s], s) for s in stalls), reverse=True)[:6]
    print(
        f"region {g}: samples {c['samples'] / total:.1%}, executed {c['executed']:.0f}, smem wavefronts "
        f"{c['smem_wavefronts']:.0f} (excess {c['smem_excess']:.0f}); "
        + ", ".join(f"{s[6:]} {v / c['samples']:.0%}" for v, s in top)
    )
print()
top_n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
ranked = sorted(range(len(body)), key=lambda i: -num(body[i], "Warp Stall Sampling (All Samples)"))[:top_n]
for i in ranked:
    r = body[i]
    s = num(r, "Warp Stall Sampling (All Samples)")
    main = sorted(((num(r, n), n) for n in stalls), reverse=True)[:2]
    print(
        f"{r[col['Address']]} r{regions[i]} {s / total:5.1%} {r[col['Source']][:60]:60s} "
        + ", ".join(f"{n[6:]} {v / max(s, 1):.0%}" for v, n in main)
    )
