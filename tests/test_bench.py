"""The benchmark harness: work formulas, the timing helper, the report, and one tiny case end to end."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DEVICE
from portattn.backends.registry import available_backends
from portattn.bench import report
from portattn.bench.ceilings import Ceilings
from portattn.bench.timing import measure, num_input_sets
from portattn.bench.work import count_work


def test_work_counts_visible_pairs_under_each_mask():
    unit = {"num_q_heads": 1, "num_kv_heads": 1, "head_dim": 1, "value_dim": 1, "element_size": 1}
    # causal prefill of 4: 1 + 2 + 3 + 4 = 10 pairs; 4 keys and 4 queries move 2 bytes each
    assert count_work([4], [4], **unit).flops == 2 * 10 * 2
    assert count_work([4], [4], **unit).bytes == 4 * 2 + 4 * 2
    # one decode at position 99 with window_left 9 sees keys 90..99: 10 pairs, 10 keys read
    w = count_work([1], [100], window_left=9, **unit)
    assert (w.flops, w.bytes) == (40, 10 * 2 + 2)
    # chunk 4, prefill of 8: each query sees its chunk's prefix: 2 * (1 + 2 + 3 + 4) = 20 pairs
    assert count_work([8], [8], chunk=4, **unit).flops == 2 * 20 * 2
    # non-causal varlen: n * L pairs; heads and dims scale it
    w = count_work([3, 5], [3, 5], num_q_heads=4, num_kv_heads=2, head_dim=8, value_dim=8, element_size=2, causal=False)
    assert w.flops == 2 * (9 + 25) * 4 * 16
    assert w.bytes == 2 * (8 * 2 * 16 + 8 * 4 * 16)


def test_measure_takes_the_median_over_rotated_inputs():
    seen = []
    timing = measure(seen.append, ["a", "b", "c"], torch.device("cpu"), warmup=2, runs=7)
    assert seen == ["a", "b", "a", "b", "c", "a", "b", "c", "a"]  # 2 warm-ups, then 7 timed
    assert timing.runs == 7 and timing.p10_ms <= timing.median_ms <= timing.p90_ms
    assert num_input_sets(1 << 30) == 2 and num_input_sets(1 << 20) == 16 and num_input_sets(100 << 20) == 6


def _row(case, mode, ms, peers):
    return {"op": "x", "case": case, "mode": mode, "flops": 4e12, "bytes": 2e9, "portattn_ms": ms, "peers": peers}


def test_report_derives_fractions_floors_ratios_and_targets(tmp_path):
    ceilings = Ceilings(copy_tb_s=4.0, matmul_tflop_s=800.0)
    rows = report.derive(
        [
            _row("decode B=64 L=4096 P=16", "decode", 1.0, {"cudnn": 1.5, "flex": "RuntimeError: no"}),
            _row("decode B=64 L=4096 P=64", "decode", 1.0, {}),
            _row("decode B=64 L=4096 P=1", "decode", 1.25, {}),
        ],
        ceilings,
    )
    first = rows[0]
    assert first["tb_s"] == pytest.approx(2.0) and first["frac_copy"] == pytest.approx(0.5)
    assert first["tflop_s"] == pytest.approx(4000.0) and first["frac_matmul"] == pytest.approx(5.0)
    assert first["floor_ms"] == pytest.approx({"bytes": 0.5, "flops": 5.0})
    assert first["vs"] == {"cudnn": pytest.approx(1.5)}  # the failed peer has no ratio
    assert rows[2]["vs_page64"] == pytest.approx(0.8)
    table = report.format_table(rows, ceilings)
    assert "flex n/a" in table and "cudnn 1.50x" in table
    assert ">= 90% of copy bandwidth     MISSED" in table
    assert ">= 1.0x cuDNN                met" in table
    assert ">= 80% of page-64 speed      met" in table
    report.write_json(tmp_path / "r.json", rows, ceilings, {"device": "x"})
    assert json.loads((tmp_path / "r.json").read_text())["cases"][0]["vs"]["cudnn"] == pytest.approx(1.5)
    pytest.importorskip("matplotlib")
    report.plot(tmp_path / "r.png", rows)
    assert (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="triton does not run here")
def test_a_tiny_paged_case_runs_end_to_end():
    from portattn.bench.paged_attention import PagedCase, run_case

    case = PagedCase(
        "tiny", 2, 1, 40, page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, peers=(), torch_backend=True
    )
    result = run_case(case, DEVICE, dtype=torch.float16)
    assert result["portattn_ms"] > 0 and result["peers"]["torch_backend"] > 0
    assert result["bytes"] == 2 * (2 * 40 * 2 * 128 + 2 * 4 * 128) + 2 * 10 * 4
