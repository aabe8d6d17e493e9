"""Derived numbers, the targets, the printed table, the JSON file and the plot."""

from __future__ import annotations

import json
from pathlib import Path

from .ceilings import Ceilings

# (case, description, predicate over the derived rows by case name) -> printed as met / missed.
TARGETS = [
    ("decode B=64 L=4096 P=16", ">= 90% of copy bandwidth", lambda r: r["frac_copy"] >= 0.90),
    ("decode B=64 L=4096 P=16", ">= 1.0x cuDNN", lambda r: r["vs"].get("cudnn", 0) >= 1.0),
    ("decode B=1 L=65536 P=16", ">= 1.0x cuDNN", lambda r: r["vs"].get("cudnn", 0) >= 1.0),
    ("decode B=1 L=65536 P=16", ">= 80% of copy bandwidth", lambda r: r["frac_copy"] >= 0.80),
    ("decode B=1 L=65536 P=16", ">= 1.0x SDPA-flash", lambda r: r["vs"].get("flash", 0) >= 1.0),
    ("decode B=64 L=4096 P=1", ">= 80% of page-64 speed", lambda r: r.get("vs_page64", 0) >= 0.80),
    ("fp8 e4m3 decode B=64 L=4096 P=16", ">= 80% of copy (fp8 bytes)", lambda r: r["frac_copy"] >= 0.80),
    ("fp8 e4m3 decode B=64 L=4096 P=16", ">= 1.6x the bf16 cache", lambda r: r["vs"].get("portattn_bf16", 0) >= 1.6),
    ("fp8 e5m2 decode B=64 L=4096 P=16", ">= 80% of copy (fp8 bytes)", lambda r: r["frac_copy"] >= 0.80),
    ("fp8 e5m2 decode B=64 L=4096 P=16", ">= 1.6x the bf16 cache", lambda r: r["vs"].get("portattn_bf16", 0) >= 1.6),
    ("prefill B=1 L=8192 causal", ">= 1.0x FlexAttention", lambda r: r["vs"].get("flex", 0) >= 1.0),
    ("prefill B=1 L=8192 causal", "reach for cuDNN (>= 1.0x)", lambda r: r["vs"].get("cudnn", 0) >= 1.0),
    ("varlen encoder 16 x 1k-4k H=16 D=80", ">= 1.2x flash varlen", lambda r: r["vs"].get("flash_varlen", 0) >= 1.2),
    ("varlen encoder 16 x 1k-4k H=16 D=80", ">= 1.0x SDPA loop", lambda r: r["vs"].get("sdpa_loop", 0) >= 1.0),
]


def derive(results: list[dict], ceilings: Ceilings) -> list[dict]:
    rows = []
    for r in results:
        s = r["portattn_ms"] * 1e-3
        row = dict(r)
        row["tb_s"] = r["bytes"] / s / 1e12
        row["tflop_s"] = r["flops"] / s / 1e12
        row["frac_copy"] = row["tb_s"] / ceilings.copy_tb_s
        row["frac_matmul"] = row["tflop_s"] / ceilings.matmul_tflop_s
        t_bytes = r["bytes"] / (ceilings.copy_tb_s * 1e12) * 1e3
        t_flops = r["flops"] / (ceilings.matmul_tflop_s * 1e12) * 1e3
        row["floor_ms"] = {"bytes": t_bytes, "flops": t_flops}
        row["vs"] = {name: ms / r["portattn_ms"] for name, ms in r["peers"].items() if isinstance(ms, float)}
        rows.append(row)
    by_name = {row["case"]: row for row in rows}
    page64 = by_name.get("decode B=64 L=4096 P=64")
    for row in rows:
        if page64 and row["case"].startswith("decode B=64 L=4096 P="):
            row["vs_page64"] = page64["portattn_ms"] / row["portattn_ms"]
    return rows


def format_table(rows: list[dict], ceilings: Ceilings) -> str:
    lines = [
        f"ceilings measured in this run: copy {ceilings.copy_tb_s:.2f} TB/s, bf16 matmul {ceilings.matmul_tflop_s:.0f} "
        "TFLOP/s",
        f"{'case':<38} {'ms':>8} {'spread':>6} {'TB/s':>6} {'%copy':>6} {'TFLOP/s':>8} {'%mm':>5} {'floor ms':>9}  "
        "peers (x = peer time / ours)",
    ]
    for r in rows:
        floor = max(r["floor_ms"].values())
        peer_txt = ", ".join(f"{n} {r['vs'][n]:.2f}x" if n in r["vs"] else f"{n} n/a" for n in r["peers"])
        lines.append(
            f"{r['case']:<38} {r['portattn_ms']:>8.3f} {100 * r.get('portattn_spread', 0):>5.1f}% {r['tb_s']:>6.2f} "
            f"{100 * r['frac_copy']:>5.0f}% "
            f"{r['tflop_s']:>8.1f} {100 * r['frac_matmul']:>4.0f}% {floor:>9.3f}  {peer_txt}"
        )
    lines.append("")
    lines.append("targets:")
    by_name = {r["case"]: r for r in rows}
    for case, what, ok in TARGETS:
        if case in by_name:
            lines.append(f"  {case:<38} {what:<28} {'met' if ok(by_name[case]) else 'MISSED'}")
    return "\n".join(lines)


def write_json(path: Path, rows: list[dict], ceilings: Ceilings, meta: dict) -> None:
    payload = {"meta": meta, "ceilings": vars(ceilings), "cases": rows}
    path.write_text(json.dumps(payload, indent=1, default=str))


# The reference backend is timed for the table, but it is no peer a fast kernel is measured against.
NOT_PEERS_IN_PLOT = ("torch_backend",)


def plot(path: Path, rows: list[dict], meta: dict | None = None, ceilings: Ceilings | None = None):
    """Two panels: every case's fraction of its ceiling, and the speed-up over each peer on a linear
    axis centred on 1.0x (bars start at 1.0: right of it portattn is faster). The title names the
    device and dtype. Only cases with a peer appear in the second panel. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = meta or {}
    compared = [r for r in rows if any(p not in NOT_PEERS_IN_PLOT for p in r["vs"])]
    heights = (max(len(rows), 1), max(len(compared), 1))
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(15, 1.2 + 0.45 * max(heights)), gridspec_kw={"width_ratios": [1, 1]}, squeeze=True
    )
    title = f"portattn on {meta.get('device_name', meta.get('device', 'unknown device'))}, {meta.get('dtype', 'bf16')}"
    if ceilings is not None:
        title += f" (ceilings: copy {ceilings.copy_tb_s:.2f} TB/s, matmul {ceilings.matmul_tflop_s:.0f} TFLOP/s)"
    fig.suptitle(title)

    names = [r["case"] for r in rows]
    frac = [r["frac_copy"] if r["mode"] == "decode" else r["frac_matmul"] for r in rows]
    bars = ax1.barh(names, frac, color=["tab:blue" if r["mode"] == "decode" else "tab:orange" for r in rows])
    ax1.bar_label(bars, labels=[f"{100 * f:.0f}%" for f in frac], padding=2, fontsize=8)
    ax1.axvline(1.0, color="k", lw=0.8)
    ax1.set_xlim(0, max(1.1, max(frac, default=1.0) * 1.15))
    ax1.set_xlabel("fraction of ceiling (decode: copy bandwidth; others: bf16 matmul)")
    ax1.invert_yaxis()

    peer_names = sorted({p for r in compared for p in r["vs"] if p not in NOT_PEERS_IN_PLOT})
    width = 0.8 / max(len(peer_names), 1)
    ratios = [r["vs"][p] for r in compared for p in peer_names if p in r["vs"]]
    reach = max((abs(x - 1.0) for x in ratios), default=0.5) * 1.25 + 0.05
    for k, peer in enumerate(peer_names):
        ys = [i - 0.4 + (k + 0.5) * width for i, r in enumerate(compared) if peer in r["vs"]]
        xs = [r["vs"][peer] for r in compared if peer in r["vs"]]
        bars = ax2.barh(ys, [x - 1.0 for x in xs], left=1.0, height=width, label=peer)
        ax2.bar_label(bars, labels=[f"{x:.2f}x" for x in xs], padding=2, fontsize=7)
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_xlim(max(0.0, 1.0 - reach), 1.0 + reach)
    ax2.set_yticks(range(len(compared)), [r["case"] for r in compared])
    ax2.set_ylim(len(compared) - 0.5, -0.5)
    ax2.set_xlabel("speed-up over peer (peer time / portattn time; > 1.0: portattn faster)")
    if peer_names:
        ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
