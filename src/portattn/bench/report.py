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
    ("decode B=64 L=4096 P=1", ">= 80% of page-64 speed", lambda r: r.get("vs_page64", 0) >= 0.80),
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
        f"{'case':<38} {'ms':>8} {'TB/s':>6} {'%copy':>6} {'TFLOP/s':>8} {'%mm':>5} {'floor ms':>9}  "
        "peers (x = peer time / ours)",
    ]
    for r in rows:
        floor = max(r["floor_ms"].values())
        peer_txt = ", ".join(f"{n} {r['vs'][n]:.2f}x" if n in r["vs"] else f"{n} n/a" for n in r["peers"])
        lines.append(
            f"{r['case']:<38} {r['portattn_ms']:>8.3f} {r['tb_s']:>6.2f} {100 * r['frac_copy']:>5.0f}% "
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


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    names = [r["case"] for r in rows]
    frac = [r["frac_copy"] if r["mode"] == "decode" else r["frac_matmul"] for r in rows]
    ax1.barh(names, frac, color=["tab:blue" if r["mode"] == "decode" else "tab:orange" for r in rows])
    ax1.set_xlabel("fraction of ceiling (decode: copy bandwidth; others: bf16 matmul)")
    ax1.invert_yaxis()
    peer_names = sorted({p for r in rows for p in r["vs"]})
    width = 0.8 / max(len(peer_names), 1)
    for k, peer in enumerate(peer_names):
        ys = [i + k * width for i in range(len(rows))]
        ax2.barh(ys, [r["vs"].get(peer, 0.0) for r in rows], height=width, label=peer)
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_yticks([i + 0.4 - width / 2 for i in range(len(rows))], names)
    ax2.set_xscale("log")
    ax2.set_xlabel("speed-up over peer (peer time / portattn time)")
    ax2.invert_yaxis()
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
