"""The host-path benchmark and the real-model benchmark's step breakdown, on the CPU (the static path
of captured decode run eagerly; the device timings are the GPU's)."""

from __future__ import annotations

import json

import pytest

from benchmarks import host_path, real_model
from portattn.engine.graphs import batch_size_buckets
from portattn.engine.llm import LLM
from portattn.testing.chat import save_tiny_chat_checkpoint

SECTIONS = {"schedule", "prepare", "model", "sample", "outputs", "step"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = save_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat") / "chat", vocab_size=384)
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_model_len=256, num_pages=80, page_size=16, enforce_eager=True)
    llm.engine.runner.enable_graphs(batch_size_buckets(4), capture=False).capture_all()
    return llm


def test_the_host_path_benchmark_writes_its_sections(tmp_path):
    out = tmp_path / "host.json"
    assert host_path.main(["--batch", "3", "--steps", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for case in ("greedy", "sampled"):
        row = result[case]
        assert set(row) == SECTIONS
        parts = sum(row[s] for s in SECTIONS - {"step"})
        assert row["prepare"] > 0 and row["outputs"] > 0 and parts == pytest.approx(row["step"], rel=0.35)


def test_the_real_model_breakdown_and_its_notes(llm, tmp_path):
    breakdown = real_model.step_breakdown(llm, steps=4)
    assert set(breakdown) == {"greedy", "sampled"}  # the device timings need captured graphs
    graphs = llm.engine.runner.graphs
    assert graphs.sampled >= 2 * (10 + 4)  # every decode step of one sequence sampled in the graph
    assert not llm.engine.requests
    for row in breakdown.values():
        assert set(row) == SECTIONS and row["step"] > 0
    gpu = dict(breakdown, replay_us=100.0, lm_head_us=10.0, draw_us=5.0, replay_kernels=361,
               replay_top_kernels=[("rmsnorm", 61)], replay_mid_context={"keys": 161, "shape": [1, 1, "short"],
                                                                         "us": 120.0})  # fmt: skip
    gpu["greedy"] = dict(breakdown["greedy"], host_us=50.0)
    gpu["sampled"] = dict(breakdown["sampled"], host_us=60.0)
    result = {"model": "/x/SmolLM2.gguf", "dtype": "bfloat16", "breakdown": gpu,
              "batch1": {"tok_per_s": 700.0, "step_ms": 1.43, "weights_floor_ms": 0.063, "copy_tb_s": 4.2,
                         "x_floor": 22.7, "ttft_ms": 17.5, "decode_step_ms": 1.367,
                         "decode_tok_per_s": 731.5}}  # fmt: skip
    result["async"] = {"batch1": {"tok_per_s": 900.0, "step_ms": 1.11, "decode_step_ms": 1.05,
                                  "decode_tok_per_s": 952.4},
                       "offline": {"total_tok_per_s": 50_000.0},
                       "same_tokens": True, "steps_ahead": 300,
                       "timeline": {"tokens": 256, "wall_us": 260_000.0, "kernels": 52_000, "busy_us": 200_000.0,
                                    "busy_per_token_us": 781.25, "idle_us": 55_000.0,
                                    "idle_by_gap_size_us": {">2us": 50_000.0, ">200us": 20_000.0},
                                    "largest_gaps_us": [900.0, 500.0], "step_calls": 257, "clocked_wall_us": 250_000.0,
                                    "step_call_us": {"p50": 800.0, "p90": 900.0, "p99": 1500.0, "max": 3000.0},
                                    "collect_wait_us": {"p10": 1.0, "p50": 300.0},
                                    "host_us_per_call": 450.0}}  # fmt: skip
    text = real_model.breakdown_notes(result)
    assert "wall 260.0 ms, kernels 52000, device busy 200.0 ms (781 us a token)" in text
    assert "(gaps >2us 50.0 ms, >200us 20.0 ms); largest gaps 900, 500 us." in text
    assert "Unprofiled (250.0 ms), its 257 engine steps: a call p50 800 / p90 900 / p99 1500 / max 3000 us" in text
    assert "waiting for ids p50 300 / p10 1 us; the host's own part 450 us a call." in text
    assert real_model.percentiles([3.0, 1.0, 2.0]) == {"p10": 1.0, "p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0,
                                                       "sum": 6.0}  # fmt: skip
    assert "Batch 1: 700 tokens/s over a 256-token generate (1.430 ms a token, the prompt's step included" in text
    assert "decode steps alone 1.367 ms (732 tokens/s) after a first token in 17.5 ms." in text
    assert "Async scheduling: batch 1 900 tokens/s (1.110 ms a token; decode steps alone 1.050 ms, 952" in text
    assert "offline 50,000 total tokens/s; " in text
    assert "offline tokens equal the synchronous run's; 300 steps launched ahead" in text
    assert "Device: the decode graph 100 us (361 kernels), of which the LM head and argmax about 10 us" in text
    assert "| greedy |" in text and "| 50 |" in text
    assert "The decode graph over 161 keys (shape (1, 1, 'short')): 120 us." in text
    real_model.plot_breakdown(tmp_path / "b.png", gpu)
    assert (tmp_path / "b.png").stat().st_size > 5_000


def test_busy_time_and_gaps_of_overlapping_kernels():
    spans = [(0.0, 4.0), (1.0, 3.0), (3.5, 6.0), (10.0, 11.0), (11.0, 12.0), (20.0, 21.0)]
    busy, gaps, first_to_last = real_model.busy_and_gaps(spans)
    assert busy == 6.0 + 2.0 + 1.0 and gaps == [4.0, 8.0] and first_to_last == 21.0
    assert real_model.busy_and_gaps([]) == (0.0, [], 0.0)


def test_the_real_model_speed_with_and_without_async_scheduling(tmp_path):
    from portattn.engine.run_ahead import RunAhead

    path = save_tiny_chat_checkpoint(tmp_path / "chat", vocab_size=384)
    runs = []
    for ahead in (False, True):
        llm = LLM(path, dtype="float32", max_num_seqs=4, max_model_len=320, num_pages=90, enforce_eager=True)
        llm.engine.runner.enable_graphs(batch_size_buckets(4), capture=False, feed=ahead).capture_all()
        if ahead:
            llm.engine.run_ahead = RunAhead(llm.engine)
        runs.append(real_model.speed(llm, [[5, 6, 7]], [[8, 9], [10, 11, 12], [13] * 5], output_len=6))
        assert not ahead or llm.engine.run_ahead.steps_ahead > 0
    (b1, off, ids), (fast_b1, fast_off, fast_ids) = runs
    assert fast_ids == ids and [len(t) for t in ids] == [6, 6, 6]
    assert off["output_tokens"] == fast_off["output_tokens"] == 18 and off["input_tokens"] == 10
    assert b1["step_ms"] == pytest.approx(1e3 / b1["tok_per_s"]) and fast_b1["tok_per_s"] > 0


def test_the_real_model_benchmark_scores_the_paragraph_as_its_logits_do(llm):
    """``paragraph_nll`` (the perplexity the benchmark records with ``--quantization``): the mean of minus each
    token's log-softmax of the logits that predict it."""
    import torch

    from portattn.engine.sampling_params import SamplingParams
    from portattn.testing import PARAGRAPH

    text = PARAGRAPH[:200]  # within the tiny engine's 256 tokens
    ids = llm.processor.tokenize(text)
    assert len(ids) > 20
    params = SamplingParams(max_tokens=1, temperature=0, return_prompt_logits=True)
    logits = llm.generate([ids], params, use_tqdm=False)[0].prompt_logits  # [len(ids), V]: row i predicts i + 1
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    want = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert real_model.paragraph_nll(llm, text) == pytest.approx(want, rel=1e-5)
