"""The serving benchmark client against a served tiny model: vLLM's definitions, JSON output."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from benchmarks import serve as bench
from portattn.testing.chat import SPECIAL_TOKENS
from server.conftest import tiny_checkpoint


def check_run(path, num_prompts: int, output_len: int) -> dict:
    out = json.loads(path.read_text())
    summary = out["summary"]
    assert summary["completed"] == num_prompts and summary["failed"] == 0
    assert summary["total_output_tokens"] == num_prompts * output_len
    assert summary["output_throughput"] == pytest.approx(summary["total_output_tokens"] / summary["duration_s"])
    for r in out["requests"]:
        # one gap per streamed chunk, one chunk per step unless the client read behind the engine
        assert r["output_len"] == output_len and 1 <= len(r["itl"]) <= output_len - 1
        assert 0 < r["ttft"] < r["latency"]
        assert r["tpot"] == pytest.approx((r["latency"] - r["ttft"]) / (output_len - 1))
        assert r["ttft"] + sum(r["itl"]) == pytest.approx(r["latency"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert set(summary[name]) == {"mean_ms", "median_ms", "p90_ms", "p99_ms"}
        assert summary[name]["median_ms"] <= summary[name]["p90_ms"] <= summary[name]["p99_ms"]
    return out


def test_bench_against_a_running_server(served, tmp_path, capsys):
    import time

    result = tmp_path / "serve.json"
    args = ["--base-url", served[0], "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "12"]
    args += ["--output-len", "5", "--token-range", "10", "300", "--result-json", str(result)]
    before = time.perf_counter()
    assert bench.main(args) == 0
    out = check_run(result, 6, 5)
    # the load's start on the clock the engine loop's trace uses, so that the two line up
    assert before < out["load_start_perf_counter_s"] < time.perf_counter() - out["summary"]["duration_s"]
    assert [r["input_len"] for r in out["requests"]] == [12] * 6
    assert out["server_metrics"]["portattn:generation_tokens_total"] >= 30
    # The result block, as vLLM's bench serve prints one: load, totals, then each latency.
    block = {}
    for line in capsys.readouterr().out.splitlines():
        if ":" in line:
            name, value = line.rsplit(":", 1)
            block[name.strip()] = value.strip()
    summary = out["summary"]
    assert block["Request rate (req/s)"] == "inf" and block["Max concurrency"] == "3"
    assert block["Successful requests"] == "6" and block["Total input tokens"] == "72"
    assert block["Total generated tokens"] == "30" and block["Dataset"] == "random"
    for name, short in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        assert float(block[f"Median {short} (ms)"]) == pytest.approx(summary[name]["median_ms"], abs=0.01)
        assert float(block[f"P99 {short} (ms)"]) == pytest.approx(summary[name]["p99_ms"], abs=0.01)


def test_random_prompts_leave_out_special_tokens(model_root):
    import random
    from argparse import Namespace

    from benchmarks.serve_datasets import load_tokenizer, random_requests

    tok = load_tokenizer(tiny_checkpoint(model_root))
    special = {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    args = Namespace(num_prompts=40, input_len=64, output_len=4, range_ratio=0.0, token_range=None)
    requests = random_requests(args, random.Random(0), tok, text=False)
    drawn = {t for r in requests for t in r.prompt}
    assert all(len(r.prompt) == 64 for r in requests) and not drawn & special
    assert len(drawn) > len(tok) // 2  # the rest of the vocabulary is used
    texts = random_requests(args, random.Random(0), tok, text=True)
    assert [r.prompt for r in texts] == [tok.decode(r.prompt) for r in requests]


def test_sharegpt_and_prompt_files_over_both_endpoints(served, model_root, tmp_path):
    tok_dir = tiny_checkpoint(model_root)
    replies = ["The cat sleeps in the warm sun.", "Rivers run to the sea.", "Bread, cakes and coffee."]
    sharegpt = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"Tell me {i}"}, {"from": "gpt", "value": r}]}
        for i, r in enumerate(replies)
    ] + [{"id": "short", "conversations": [{"from": "human", "value": "alone"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(sharegpt))
    result = tmp_path / "chat.json"
    args = ["--base-url", served[0], "--endpoint", "/v1/chat/completions", "--dataset", str(path)]
    args += ["--tokenizer", tok_dir, "--num-prompts", "10", "--result-json", str(result)]
    assert bench.main(args) == 0
    out = json.loads(result.read_text())
    assert out["config"]["dataset"] == "sharegpt" and out["summary"]["completed"] == 10  # 3 replies, repeated
    from benchmarks.serve_datasets import load_tokenizer

    tok = load_tokenizer(tok_dir)
    lengths = [r["output_len"] for r in out["requests"]]  # every reply three times, one a fourth time
    assert sorted(lengths.count(len(tok(r).input_ids)) for r in replies) == [3, 3, 4]
    # one gap per streamed chunk: a chunk holds several tokens where the client read behind the engine
    assert all(r["input_len"] > 3 and 1 <= len(r["itl"]) <= r["output_len"] - 1 for r in out["requests"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "output_len": 3}) for p in ("A paged cache", "Hello")))
    result = tmp_path / "prompts.json"
    args = ["--base-url", served[0], "--dataset", str(prompts), "--num-prompts", "2", "--result-json", str(result)]
    assert bench.main(args) == 0
    out = check_run(result, 2, 3)
    assert out["config"]["dataset"] == "prompts"
    assert sorted(r["input_len"] for r in out["requests"]) == sorted(
        len(tok(p).input_ids) for p in ("A paged cache", "Hello")
    )


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


def test_the_project_prompt_set_is_a_dataset():
    import random
    from argparse import Namespace

    from benchmarks.serve_datasets import load_requests

    path = Path(bench.__file__).parent / "prompts" / "chat.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    args = Namespace(dataset_path=str(path), dataset_name=None, num_prompts=2 * len(lines), output_len=32)
    name, requests = load_requests(args, random.Random(0), None, text=True)
    # More requests than prompts: the file twice over, each pass in its own order.
    prompts = sorted(x["prompt"] for x in lines)
    assert name == "prompts" and sorted(r.prompt for r in requests) == sorted(prompts * 2)
    assert sorted(r.prompt for r in requests[: len(lines)]) == prompts
    assert {r.output_len for r in requests} == {32}


def _serve_result(path: Path, itls_ms: list[list[float]], ttfts_s: list[float], server_args: list[str]) -> None:
    """A result JSON as ``benchmarks.serve`` writes it, from each request's ITLs and TTFT."""
    results = [
        bench.RequestResult(input_len=8, output_len=len(itl) + 1, ttft=ttft, latency=ttft + sum(itl) / 1000,
                            itl=[gap / 1000 for gap in itl])
        for itl, ttft in zip(itls_ms, ttfts_s)
    ]  # fmt: skip
    summary = bench.summarize(results, duration=10.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": {"server_args": server_args}, "summary": summary,
                                "requests": [bench.asdict(r) for r in results]}))  # fmt: skip


def test_serve_report_checks_each_load_against_its_target(tmp_path):
    from benchmarks import serve_report

    # burst: 100 gaps of 10 ms and one of 100 ms a request (under 1% of the gaps: p99 10 ms), TTFT mean 2 s
    _serve_result(tmp_path / "b2048" / "serve_burst256.json", [[10.0] * 100 + [100.0]] * 4, [1.0, 2.0, 2.0, 3.0],
                  ["--max-num-batched-tokens", "2048"])  # fmt: skip
    _serve_result(tmp_path / "b2048" / "serve_poisson16.json", [[10.0, 10.0, 19.0, 0.5]] * 3, [0.1] * 3, [])
    _serve_result(tmp_path / "b2048" / "serve_conc1.json", [[5.0] * 9] * 2, [0.05] * 2, [])
    _serve_result(tmp_path / "b8192" / "serve_burst256.json", [[10.0] * 10 + [200.0] * 2] * 4, [3.0] * 4, [])
    big = tmp_path / "b8192" / "serve_burst256.json"  # kept as gzip, read the same
    (tmp_path / "b8192" / "serve_burst256.json.gz").write_bytes(gzip.compress(big.read_bytes()))
    big.unlink()
    assert serve_report.main([str(tmp_path / "b2048"), str(tmp_path / "b8192"), "--out", str(tmp_path / "out"),
                              "--batch1-step-ms", "4.8"]) == 0  # fmt: skip
    text = (tmp_path / "out" / "serve_gpu.md").read_text()
    burst = next(line for line in text.splitlines() if "| b2048 (--max-num-batched-tokens 2048) | burst256 |" in line)
    # the 100 ms gaps of the two streams that started together stop 2 of the 3 open then; the last stream's,
    # open alone, stops all there are
    assert "| 4/4 |" in burst and "| 0% | 2 (180 ms) | ITL p99 1.0x the median, TTFT mean 2.00 s: met" in burst
    big = next(line for line in text.splitlines() if "| b8192 | burst256 |" in line)
    assert "ITL p99 20.0x the median, TTFT mean 3.00 s: not met" in big
    poisson = next(line for line in text.splitlines() if "| poisson16 |" in line)
    # 12 gaps, three of 19 ms, three of 0.5 ms (chunks that came together): p99 19 ms, median 10
    assert "| 25% | 1 (9 ms) | ITL p99 1.9x the median: met" in poisson
    conc1 = next(line for line in text.splitlines() if "| conc1 |" in line)
    assert "TPOT 1.04x the batch-1 step (4.80 ms): met" in conc1
    assert (tmp_path / "out" / "serve_gpu.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):  # a folder without results
        serve_report.main([str(tmp_path / "out"), "--out", str(tmp_path / "out")])


def test_serve_report_finds_the_moments_every_stream_stopped():
    """Eight streams of 10 ms gaps, sent 5 ms apart: a step of 40 ms at 1.0 s stops every open stream
    (one stop of 30 ms more than the gaps around it); one stream's own long gap, and streams that
    had not started, are not a stop; results without send times have none to report."""
    from benchmarks import serve_report

    requests = []
    for i in range(8):
        start, ttft, t, itl = 0.005 * i, 0.1, 0.005 * i + 0.1, []
        while t < 2.0:
            gap = 0.04 if abs(t + 0.01 - 1.0) < 0.005 else 0.01  # the one step that took 40 ms
            if i == 3 and abs(t - 1.5) < 0.005:
                gap = 0.05  # one stream's own pause
            itl.append(gap)
            t += gap
        requests.append({"start": start, "ttft": ttft, "itl": itl, "error": None})
    late = {"start": 1.2, "ttft": 0.1, "itl": [0.01] * 50, "error": None}  # opens after the stop
    found = serve_report.stalls([*requests, late])
    assert len(found) == 1
    at, extra, begun = found[0]
    assert 1.0 <= at <= 1.04 and extra == pytest.approx(0.03, abs=1e-6) and begun == 8  # (not the late stream)
    assert serve_report.stalls([{k: v for k, v in r.items() if k != "start"} for r in requests]) is None
    assert serve_report._stalled(found) == "1 (30 ms)" and serve_report._stalled(None) == "-"
