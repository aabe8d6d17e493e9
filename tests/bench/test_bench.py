"""The benchmark harness: work formulas, the timing helper, the report, and one tiny case end to end."""

from __future__ import annotations

import functools
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


def test_fp8_targets_count_fp8_bytes_and_the_bf16_cache():
    ceilings = Ceilings(copy_tb_s=4.0, matmul_tflop_s=800.0)
    rows = report.derive(
        [
            _row("decode B=64 L=4096 P=16", "decode", 1.0, {}),
            {**_row("fp8 e4m3 decode B=64 L=4096 P=16", "decode", 0.5, {"portattn_bf16": 0.95}), "bytes": 1.9e9},
        ],
        ceilings,
    )
    table = report.format_table(rows, ceilings)
    assert rows[1]["frac_copy"] == pytest.approx(0.95) and rows[1]["vs"]["portattn_bf16"] == pytest.approx(1.9)
    assert ">= 80% of copy (fp8 bytes)   met" in table and ">= 1.6x the bf16 cache       met" in table


def test_plot_panels(tmp_path):
    pytest.importorskip("matplotlib")
    ceilings = Ceilings(copy_tb_s=4.0, matmul_tflop_s=800.0)
    rows = report.derive(
        [
            _row("decode B=64 L=4096 P=16", "decode", 1.0, {"cudnn": 1.1, "torch_backend": 40.0}),
            _row("decode B=64 L=4096 P=64", "decode", 1.0, {}),  # no peer: first panel only
            _row("prefill B=1 L=8192 causal", "prefill", 2.0, {"flex": 1.8, "cudnn": "RuntimeError: no"}),
            _row("extend B=8 512 over 8192", "extend", 1.0, {"torch_backend": 9.0}),  # the reference alone
        ],
        ceilings,
    )
    fig = report.plot(tmp_path / "r.png", rows, {"device_name": "NVIDIA H200", "dtype": "bf16"}, ceilings)
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert fig._suptitle.get_text().startswith("portattn on NVIDIA H200, bf16 (ceilings: copy 4.00 TB/s")
    fractions, speedups = fig.axes[:2]
    assert [t.get_text() for t in fractions.get_yticklabels()] == [r["case"] for r in rows]
    assert [t.get_text() for t in speedups.get_yticklabels()] == [
        "decode B=64 L=4096 P=16",
        "prefill B=1 L=8192 causal",
    ]
    assert [t.get_text() for t in speedups.get_legend().get_texts()] == ["cudnn", "flex"]  # no torch_backend
    assert speedups.get_xscale() == "linear"
    low, high = speedups.get_xlim()
    assert low < 1.0 < high and high - 1.0 == pytest.approx(1.0 - low)  # centred on 1.0x


@pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="triton does not run here")
def test_a_tiny_paged_case_runs_end_to_end():
    from portattn.bench.paged_attention import PagedCase, run_case

    case = PagedCase(
        "tiny", 2, 1, 40, page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, peers=(), torch_backend=True
    )
    result = run_case(case, DEVICE, dtype=torch.float16)
    assert result["portattn_ms"] > 0 and result["peers"]["torch_backend"] > 0
    assert result["bytes"] == 2 * (2 * 40 * 2 * 128 + 2 * 4 * 128) + 2 * 10 * 4


@pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="triton does not run here")
def test_a_tiny_fp8_case_runs_end_to_end(monkeypatch):
    """The fp8 case times the fp8 cache and, as its peer, the same call on the model-dtype cache."""
    from portattn.bench import paged_attention
    from portattn.bench.paged_attention import PagedCase, run_case
    from portattn.runtime import kv_cache

    monkeypatch.setattr(paged_attention, "measure", functools.partial(measure, warmup=1, runs=5))  # interpreted

    case = PagedCase(
        "tiny fp8", 2, 1, 40, page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, peers=(), kv_cache="fp8_e5m2"
    )
    result = run_case(case, DEVICE, dtype=torch.float16)
    assert result["portattn_ms"] > 0 and result["peers"]["portattn_bf16"] > 0
    other = "portattn_fp8_v_rows" if kv_cache.FP8_V_KEYS_CONTIGUOUS else "portattn_fp8_v_keys"
    assert result["peers"][other] > 0  # the V layout the engine's pool does not use
    # K/V at one byte per element; queries, outputs (two bytes) and the page table as before
    assert result["bytes"] == 1 * (2 * 40 * 2 * 128) + 2 * (2 * 4 * 128) + 2 * 10 * 4


def test_the_guard_fails_a_case_more_than_ten_percent_slower():
    from portattn.bench import guard

    baseline = {case: 1.0 for case in guard.GUARDED}
    assert guard.slowdowns(dict(baseline), baseline) == []
    assert guard.slowdowns({**baseline, guard.GUARDED[0]: 1.099}, baseline) == []  # within 10%
    slower = guard.slowdowns({**baseline, guard.GUARDED[1]: 1.11}, baseline)
    assert len(slower) == 1 and slower[0].startswith(guard.GUARDED[1]) and "1.11x" in slower[0]
    missing = {c: t for c, t in baseline.items() if c != guard.GUARDED[2]}
    assert guard.slowdowns(missing, baseline) == [f"{guard.GUARDED[2]}: not measured"]
    assert guard.slowdowns(baseline, missing) == [f"{guard.GUARDED[2]}: no graph-timed baseline"]
    payload = {"cases": [{"case": "a", "portattn_ms": 2.0, "timing": "graph"}, {"case": "b", "portattn_ms": 1.0}]}
    assert guard.baseline_times(payload) == {"a": 2.0}  # burst-timed runs are no baseline


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the guard times CUDA graphs")
def test_no_guarded_case_is_slower_than_the_committed_baseline():
    """GPU suite: the guarded cases against benchmarks/results/round10_h200/baseline.json (same device model)."""
    from pathlib import Path

    from portattn.bench import guard

    failures, report_text = guard.check(Path(__file__).parents[2] / guard.BASELINE, DEVICE)
    print(report_text)
    assert not failures, "\n".join(failures)


def test_the_mla_benchmark_counts_fp8_bytes_and_reports_fp8_caches_beside_bf16():
    """``portattn.bench.mla --fp8``: an fp8 cache's latent counts a byte a value, and each case's row and table give
    the fp8 caches' device time, time with the calls launched from the host, ratio to the bf16 cache's and share of
    the copy bandwidth (or their error)."""
    from portattn.bench import mla

    bf16, flops = mla.case_cost(64, 128, 4096, 64)
    fp8, fp8_flops = mla.case_cost(64, 128, 4096, 64, cache_bytes=1)
    assert bf16 - fp8 == 64 * 4096 * 576 and flops == fp8_flops
    default = {"tiles": {}, "num_kv_splits": 1, "ms": 0.2, "queued_ms": 0.21, "single_call_ms": 0.25, "tb_s": 1.5,
               "tflop_s": 300.0}  # fmt: skip
    e4m3 = {"tiles": {}, "num_kv_splits": 1, "ms": 0.125, "queued_ms": 0.15, "tb_s": 1.2, "speedup_vs_bf16": 1.6}
    res = {"batch": 64, "heads": 128, "length": 4096, "page_size": 64, "default": default, "e4m3": e4m3,
           "e5m2": {"error": "ValueError: no"}}  # fmt: skip
    row = mla._row(res, copy_gb_s=3000.0, mm_tflops=600.0)
    assert "e4m3 0.125 ms (x1.60, 40% copy; queued 0.150)" in row and "e5m2 error: ValueError: no" in row
    assert "0.200 ms (queued 0.210)" in row
    header, _, line = mla._table([res], copy_gb_s=3000.0, mm_tflops=600.0).splitlines()
    assert "| ms | queued ms | 1 call ms |" in header
    assert header.endswith("| e4m3 ms | e4m3 queued ms | e4m3 x bf16 | e4m3 % copy | e5m2 ms | e5m2 queued ms |"
                           " e5m2 x bf16 | e5m2 % copy |")  # fmt: skip
    assert "| 0.200 | 0.210 | 0.250 |" in line and line.endswith("| 0.125 | 0.150 | 1.60 | 40 | error | | | |")


def test_the_mla_benchmark_times_the_plan_an_engine_makes(monkeypatch):
    """The default rows (the bf16 cache and each fp8 one) run as the Triton backend runs a plan it made itself: at the
    plan's split count, with its ``min_split_keys`` and ``fewer_splits`` (a kernel filling each SM once may take fewer
    splits); a sweep's variants at the split counts they name. Until round 68 the default rows re-planned at the
    chosen count given explicitly, so the fp8 kernels ran 4 splits at 17 heads where an engine runs 2."""
    from portattn.bench import mla
    from portattn.bench.timing import Timing
    from portattn.kernels.triton import mla_decode_launch

    calls = []

    def forward(*args, **kwargs):
        calls.append(kwargs)

    monkeypatch.setattr(mla_decode_launch, "mla_decode_forward", forward)
    timed = lambda fn, inputs, device, **kw: (fn(inputs[0]), Timing(0.1, 0.1, 0.1, 1))[1]
    monkeypatch.setattr(mla, "measure", timed)
    monkeypatch.setattr(mla, "measure_graph", timed)
    gen = torch.Generator().manual_seed(0)
    pool = torch.zeros(4 * 5 * 64, 576, dtype=torch.bfloat16)  # 4 sequences of 300 keys in pages of 64
    fp8 = torch.zeros(pool.shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    res = mla.run_case(pool, 4, 17, 300, 64, sweep=False, torch_check=False, gen=gen, device=torch.device("cpu"),
                       fp8_pools={"e4m3": (fp8, 1.0)})  # fmt: skip
    plan = mla.plan_mla_decode(torch.zeros(4, 5, dtype=torch.int32), torch.full((4,), 300, dtype=torch.int32), 64,
                               num_heads=17, kv_lora_rank=512, max_seqlen_k=300)  # fmt: skip
    assert plan.splits_chosen and calls
    for kwargs in calls:
        assert kwargs["fewer_splits"] is True and kwargs["min_split_keys"] == plan.min_split_keys, kwargs
        assert kwargs["num_kv_splits"] == plan.num_kv_splits, kwargs
    assert res["default"]["num_kv_splits"] == res["e4m3"]["num_kv_splits"] == plan.num_kv_splits


def test_the_mla_benchmarks_case_lists_take_comma_separated_positive_integers():
    """``--heads 17,32,64`` and the like; anything else is refused naming what was expected and what came."""
    import argparse

    from portattn.bench import mla

    assert mla._ints("17,32,64") == (17, 32, 64)
    assert mla._ints("4096") == (4096,)
    for bad in ("", "17,,32", "0,4", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"positive integers, got {bad!r}"):
            mla._ints(bad)


def test_the_mla_benchmarks_pool_holds_every_cases_pages_at_every_page_size():
    """Lengths that are no multiple of a page size take a partly filled last page; the pool divides into pages of
    every page size and holds the largest batch's pages."""
    from portattn.bench import mla

    assert mla.pool_rows(mla.BATCHES, mla.LENGTHS, mla.PAGE_SIZES) == 128 * 32768  # the default grid, as before
    rows = mla.pool_rows((3, 8), (1000, 64), (64, 7))
    assert rows % 64 == 0 and rows % 7 == 0
    assert rows // 64 >= 8 * -(-1000 // 64) and rows // 7 >= 8 * -(-1000 // 7)
