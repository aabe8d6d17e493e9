"""``python -m benchmarks.serve_report``: the notes and the plot of serving runs.

Reads the result JSONs (or their gzip files) that ``python -m benchmarks.serve --result-json`` wrote
(``scripts/gpu.sh "bench serve"`` writes ``serve_conc1.json``, ``serve_poisson16.json`` and
``serve_burst256.json`` into one folder per server configuration) and writes ``serve_gpu.md`` (a table
of every run and the serving targets: under a burst ITL p99 <= 3x its median and TTFT mean <= 2.5 s;
at Poisson 16 req/s ITL p99 <= 2x the median; at concurrency 1 TPOT <= 1.1x the engine's batch-1
decode step, given by ``--batch1-step-ms``) and ``serve_gpu.png`` (each run's ITL distribution and
TTFTs).

    python -m benchmarks.serve_report RUN_DIR [RUN_DIR ...] --out DIR --batch1-step-ms 5.3
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from pathlib import Path

TARGETS = {  # load name: what the serving target asks of it
    "burst": "ITL p99 <= 3x the median, TTFT mean <= 2.5 s",
    "poisson16": "ITL p99 <= 2x the median",
    "conc1": "TPOT <= 1.1x the batch-1 decode step",
}


def load_runs(dirs: list[Path]) -> list[dict]:
    """One row per result JSON: its folder (the server configuration), its load name and its summary."""
    runs = []
    for folder in dirs:
        for path in sorted([*folder.glob("serve_*.json"), *folder.glob("serve_*.json.gz")]):
            text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            data = json.loads(text)
            done = [r for r in data.get("requests", []) if r.get("error") is None]
            itls = [gap for r in done for gap in r.get("itl", [])]
            ttfts = [r["ttft"] for r in done]
            config = data.get("config", {})
            runs.append({
                "config": folder.name,
                "server_args": " ".join(config.get("server_args") or []),
                "load": path.name.split(".")[0].removeprefix("serve_"),
                "summary": data["summary"],
                "itls": itls,
                "ttfts": ttfts,
                "stalls": stalls(done),
            })  # fmt: skip
    return runs


STALL_RATIO = 1.8  # a gap this many times the gaps around it (STALL_WINDOW_S either side) is long
STALL_WINDOW_S = 0.25
STALL_SHARE = 0.5  # a stall: long gaps ending together (within STALL_JOIN_S) in this share of the open streams
STALL_JOIN_S = 0.01


def stalls(requests: list[dict]) -> list[tuple[float, float, int]] | None:
    """The moments every stream stopped at once: long gaps (over ``STALL_RATIO`` times the median gap of
    every stream within ``STALL_WINDOW_S``) that end together in at least ``STALL_SHARE`` of the streams
    open then. Each as ``(time from the load's start, its median gap less the median around it, the streams
    that had their first token before it)``, times in seconds: a step that took twice its time, a pause of
    the server or the engine, which a percentile over all gaps blurs; the count of streams places it in the
    load (a stop that comes each time the batch passes a size says which size). None for results without
    the requests' send times (written before they were kept)."""
    if not requests or any("start" not in r for r in requests):
        return None
    ends, spans = [], []  # (time a gap ends, the gap); (first token, last token) of each stream
    for r in requests:
        t = first = r["start"] + r["ttft"]
        for gap in r.get("itl", []):
            t += gap
            ends.append((t, gap))
        spans.append((first, t))
    if not ends:
        return []
    ends.sort()
    times = [t for t, _ in ends]
    firsts = sorted(first for first, _ in spans)
    medians: dict[int, float] = {}  # per bin of STALL_JOIN_S: the median gap ending within STALL_WINDOW_S of it

    def around(t: float) -> float:
        b = int(t / STALL_JOIN_S)
        if b not in medians:
            lo = bisect.bisect_left(times, b * STALL_JOIN_S - STALL_WINDOW_S)
            hi = bisect.bisect_right(times, (b + 1) * STALL_JOIN_S + STALL_WINDOW_S)
            medians[b] = statistics.median(g for _, g in ends[lo:hi])
        return medians[b]

    long = [(t, gap, around(t)) for t, gap in ends if gap > STALL_RATIO * around(t)]
    found, group = [], []
    for item in [*long, (float("inf"), 0.0, 0.0)]:
        if group and item[0] - group[-1][0] > STALL_JOIN_S:
            at = group[0][0]
            open_streams = sum(first < at - group[0][1] / 2 and last >= at for first, last in spans)
            if len(group) >= STALL_SHARE * max(open_streams, 1):
                extra = statistics.median(g for _, g, _ in group) - statistics.median(x for *_, x in group)
                found.append((at, extra, bisect.bisect_left(firsts, at)))
            group = []
        group.append(item)
    return found


def target(run: dict, batch1_step_ms: float | None) -> str:
    """The run's serving target and whether it is met ("-" for a load without one)."""
    s, load = run["summary"], run["load"]
    itl, ttft, tpot = s.get("itl", {}), s.get("ttft", {}), s.get("tpot", {})
    if not itl:
        return "-"
    ratio = itl["p99_ms"] / _median(itl)
    if load.startswith("burst"):
        met = ratio <= 3 and ttft["mean_ms"] <= 2500
        return f"ITL p99 {ratio:.1f}x the median, TTFT mean {ttft['mean_ms'] / 1000:.2f} s: {_met(met)}"
    if load.startswith("poisson16"):
        return f"ITL p99 {ratio:.1f}x the median: {_met(ratio <= 2)}"
    if load.startswith("conc1") and batch1_step_ms:
        over = tpot["mean_ms"] / batch1_step_ms
        return f"TPOT {over:.2f}x the batch-1 step ({batch1_step_ms:.2f} ms): {_met(over <= 1.1)}"
    return "-"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def notes(runs: list[dict], batch1_step_ms: float | None) -> str:
    lines = ["# Serving on the GPU", "",
             "Streamed requests through the OpenAI server (`python -m benchmarks.serve`; ITL: gaps between "
             "streamed chunks; TPOT: (E2EL - TTFT) / (output - 1)). Targets: " +
             "; ".join(f"{load}: {text}" for load, text in TARGETS.items()) + ".", "",
             "| server | load | done | out tok/s | TTFT mean / p99 ms | TPOT mean ms | ITL median / p90 / p99 ms "
             "| gaps under 1 ms | every stream stopped | target |", "|" + "---|" * 10]  # fmt: skip
    for run in runs:
        s = run["summary"]
        ttft, tpot, itl = s.get("ttft", {}), s.get("tpot", {}), s.get("itl", {})
        lines.append(
            f"| {run['config']}{' (' + run['server_args'] + ')' if run['server_args'] else ''} | {run['load']} "
            f"| {s['completed']}/{s['completed'] + s['failed']} | {s['output_throughput']:,.0f} "
            f"| {_ms(ttft, 'mean_ms')} / {_ms(ttft, 'p99_ms')} | {_ms(tpot, 'mean_ms')} "
            f"| {_ms(itl, 'median_ms' if 'median_ms' in itl else 'p50_ms')} / {_ms(itl, 'p90_ms')} / "
            f"{_ms(itl, 'p99_ms')} | {_bunched(run['itls'])} | {_stalled(run['stalls'])} "
            f"| {target(run, batch1_step_ms)} |"
        )
    stalled = [run for run in runs if run["stalls"]]
    if stalled:
        lines += [
            "",
            "Every stream stopped at once (seconds from the load's start; each stop's extra time in ms and the "
            "streams that had their first token before it):",
        ]
        lines += [
            f"- {run['config']} {run['load']}: "
            + ", ".join(f"{at:.2f} s (+{1000 * extra:.0f}, {begun})" for at, extra, begun in run["stalls"][:40])
            + (f" and {len(run['stalls']) - 40} more" if len(run["stalls"]) > 40 else "")
            for run in stalled
        ]
    return "\n".join(lines) + "\n"


def _stalled(found: list | None) -> str:
    """How often every stream stopped at once (:func:`stalls`) and the time it cost them; "-" for results
    without send times."""
    if found is None:
        return "-"
    return f"{len(found)} ({1000 * sum(extra for _, extra, _ in found):.0f} ms)" if found else "0"


def _bunched(itls: list[float]) -> str:
    """The share of gaps under 1 ms: chunks of a request that arrived together (a server behind its
    streams), which make the median ITL say little; "-" without per-request results."""
    if not itls:
        return "-"
    return f"{sum(gap < 1e-3 for gap in itls) / len(itls):.0%}"


def _median(stats: dict) -> float:
    return stats["median_ms"] if "median_ms" in stats else stats["p50_ms"]  # older results: p50_ms


def _ms(stats: dict, key: str) -> str:
    return f"{stats[key]:.1f}" if key in stats else "-"


def plot(out: Path, runs: list[dict]) -> Path | None:
    """Each run's ITL distribution (left) and TTFT distribution (right), one line per run."""
    if not any(run["itls"] for run in runs):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_itl, ax_ttft) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in runs:
        label = f"{run['config']} {run['load']}"
        for ax, values in ((ax_itl, run["itls"]), (ax_ttft, run["ttfts"])):
            if values:
                ms = sorted(v * 1000 for v in values)
                ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=label)
    for ax, name in ((ax_itl, "inter-token latency"), (ax_ttft, "time to first token")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name}, ms (log)")
        ax.set_ylabel("fraction of samples")
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
    ax_itl.legend(fontsize=7)
    fig.tight_layout()
    path = out / "serve_gpu.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="folders of serve_*.json, one per server configuration")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch1-step-ms", type=float, help="the engine's batch-1 decode step (conc1's target)")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    if not runs:
        parser.error(f"expected serve_*.json files in {', '.join(map(str, args.runs))}, found none")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_gpu.md").write_text(notes(runs, args.batch1_step_ms))
    plot(args.out, runs)
    print((args.out / "serve_gpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
