"""``python -m portattn.bench [--case SUBSTRING] [--sweep] [--graph] [--out DIR] [--tag NAME]`` (needs a GPU).

Measures the ceilings, then every case of ``paged_attention`` and ``varlen_attention`` in bf16,
prints the table and writes ``DIR/<tag>.json`` and ``DIR/<tag>.png``. ``--graph`` times every
call as CUDA-graph replays (median and spread of many replays; the timing the benchmark guard
``python -m portattn.bench.guard`` compares), else in bursts of queued calls.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..device import default_device, device_model, is_gpu
from . import paged_attention, report, varlen_attention
from .ceilings import measure_ceilings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portattn.bench", description=__doc__)
    parser.add_argument("--case", action="append", default=None, help="run cases whose name contains this")
    parser.add_argument("--sweep", action="store_true", help="also time other tile shapes and split counts")
    parser.add_argument("--graph", action="store_true", help="time calls as CUDA-graph replays")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG files")
    parser.add_argument("--tag", default="bench", help="file name stem")
    parser.add_argument(
        "--write-tiles", nargs="?", const="", default=None, metavar="FILE",
        help="with --sweep --graph: set this device model's entries of the tile table (default: the package's "
        "kernels/triton/tile_table.json) from the sweep",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.write_tiles is not None and not (args.sweep and args.graph):
        # In bursts a call of tens of microseconds is timed at the host's launch pace, whatever its tiles.
        parser.error("--write-tiles takes its tiles from a sweep timed as graph replays: add --sweep --graph")
    device = default_device()
    if not is_gpu(device):
        print(f"the benchmark needs a GPU (found {device}); the kernels' CPU path is the Triton interpreter")
        return 1
    cases = [(paged_attention, c) for c in paged_attention.CASES] + [
        (varlen_attention, c) for c in varlen_attention.CASES
    ]
    if args.case:
        cases = [(m, c) for m, c in cases if any(s in c.name for s in args.case)]
    import triton

    from ..device import describe_device

    info = describe_device(device)
    meta = {"device": str(device), "device_name": info["name"], "driver": info["driver"], "dtype": "bf16"}
    meta |= {"torch": torch.__version__, "triton": triton.__version__, "timing": "graph" if args.graph else "burst"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(device)
    results = []
    for module, case in cases:
        t0 = time.time()
        results.append(module.run_case(case, device, sweep=args.sweep, graph=args.graph))
        rows = report.derive(results, ceilings)
        report.write_json(out / f"{args.tag}.json", rows, ceilings, meta)  # kept current if a later case fails
        print(report.format_table(rows[-1:], ceilings).splitlines()[2], f"({time.time() - t0:.0f} s)", flush=True)
        if hasattr(torch.accelerator, "empty_cache"):
            torch.accelerator.empty_cache()
    try:
        report.plot(out / f"{args.tag}.png", rows, meta, ceilings)
    except ImportError as exc:
        print(f"no plot ({exc}); install matplotlib (`pip install portattn[bench]`)")
    if args.sweep:
        for r in rows:
            for key, ms in r.get("sweep", {}).items():
                print(f"sweep {r['case']:<38} {key:<36} {ms if isinstance(ms, str) else f'{ms:.3f} ms'}")
    print(report.format_table(rows, ceilings))
    if args.write_tiles is not None:
        write_tiles(Path(args.write_tiles) if args.write_tiles else None, device_model(device), results)
    return 0


def write_tiles(path: Path | None, device_name: str, results: list[dict]) -> None:
    """Set ``device_name``'s entries of the tile table at ``path`` (None: the package's) from the swept
    cases of ``results``, and print what changed."""
    from ..kernels.triton import launch, tile_table

    path = path or tile_table.TABLE
    old = tile_table.load(path)
    timings = [
        (t["key"], t["rule"], t["rule_ms"], [(entry, ms) for entry, ms in t["candidates"]])
        for t in (r.get("sweep_table") for r in results)
        if t and isinstance(t.get("rule_ms"), float)
    ]
    new = tile_table.updated(old, device_name, timings)
    tile_table.write(path, new)
    launch.choose_tiles.cache_clear()  # later launches of this process take the new entries
    before, after = old.get(device_name, {}), new.get(device_name, {})
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            print(f"tile table {device_name} [{key}]: {before.get(key, 'rules')} -> {after.get(key, 'rules')}")
    print(f"tile table {path}: {len(after)} entries for {device_name}")


if __name__ == "__main__":
    sys.exit(main())
