"""The serving benchmark client against a served tiny model: vLLM's definitions, JSON output."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from benchmarks import serve as bench
from server.conftest import tiny_checkpoint


def check_run(path, num_prompts: int, output_len: int) -> dict:
    out = json.loads(path.read_text())
    summary = out["summary"]
    assert summary["completed"] == num_prompts and summary["failed"] == 0
    assert summary["total_output_tokens"] == num_prompts * output_len
    assert summary["output_throughput"] == pytest.approx(summary["total_output_tokens"] / summary["duration_s"])
    for r in out["requests"]:
        assert r["output_len"] == output_len and len(r["itl"]) == output_len - 1  # one chunk per step
        assert 0 < r["ttft"] < r["latency"]
        assert r["tpot"] == pytest.approx((r["latency"] - r["ttft"]) / (output_len - 1))
        assert r["ttft"] + sum(r["itl"]) == pytest.approx(r["latency"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert set(summary[name]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}
        assert summary[name]["p50_ms"] <= summary[name]["p90_ms"] <= summary[name]["p99_ms"]
    return out


def test_bench_against_a_running_server(served, tmp_path):
    result = tmp_path / "serve.json"
    args = ["--base-url", served[0], "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "12"]
    args += ["--output-len", "5", "--token-range", "10", "300", "--result-json", str(result)]
    assert bench.main(args) == 0
    out = check_run(result, 6, 5)
    assert [r["input_len"] for r in out["requests"]] == [12] * 6
    assert out["server_metrics"]["portattn:generation_tokens_total"] >= 30


@pytest.mark.slow
def test_bench_starts_its_own_server(model_root, tmp_path):
    result = tmp_path / "serve.json"
    args = ["--start-server", "--model", tiny_checkpoint(model_root), "--num-prompts", "5", "--request-rate", "50"]
    args += ["--input-len", "8", "--output-len", "4", "--range-ratio", "0.5", "--token-range", "10", "300"]
    args += ["--result-json", str(result), "--", "--page-size", "8"]
    assert bench.main(args) == 0
    out = json.loads(result.read_text())
    assert out["summary"]["completed"] == 5 and out["config"]["server_args"] == ["--page-size", "8"]
    assert all(4 <= r["input_len"] <= 12 for r in out["requests"])


def test_random_checkpoint_of_a_real_shape_loads(tmp_path):
    from benchmarks.random_checkpoint import write_random_llama
    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams

    path = write_random_llama(tmp_path / "tiny", "tiny", dtype=torch.float32)
    llm = LLM(path, page_size=8, num_pages=16, max_model_len=128)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and out.text == " ".join(f"t{t}" for t in out.token_ids)
