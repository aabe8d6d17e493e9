"""The GPU engine benchmark's pieces on the CPU: random checkpoints, one decode point, the notes."""

from __future__ import annotations

import json
import time

import pytest
import torch

from benchmarks import engine as bench
from benchmarks.random_checkpoint import write_random_checkpoint


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")


def tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip


def test_random_checkpoint_loads_and_is_reused(tmp_path, cpu):
    from portattn.engine.llm import LLM

    path = write_random_checkpoint(tiny_llama(), tmp_path / "ckpt", device="cpu")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.down_proj.weight" in index["weight_map"]
    stamp = (path / "stamp.txt").stat().st_mtime_ns
    assert write_random_checkpoint(tiny_llama(), tmp_path / "ckpt", device="cpu") == path
    assert (path / "stamp.txt").stat().st_mtime_ns == stamp  # reused, not rewritten
    llm = LLM(str(path), page_size=4, num_pages=64, max_model_len=256, max_num_seqs=4)
    model = llm.engine.model
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    assert 0.01 < float(model.model.layers[0].mlp.down_proj.weight.std()) < 0.03
    row = bench.decode_point(llm, batch=2, context=20, steps=3, copy_tb_s=1e-3)
    assert row["eager_step_ms"] > 0 and row["limit_ms"] > 0 and "graphs_step_ms" not in row  # no graphs on the CPU
    assert row["kv_bytes"] == 2 * (20 + 6) * 2 * 2 * 2 * 8 * 4  # batch, mean context, layers, k+v, heads, dim, fp32
    assert not llm.engine.requests  # every request aborted


@pytest.mark.parametrize("option", sorted(o for o, where in bench.KERNEL_OPTIONS.items() if where))
def test_each_kernel_option_sets_an_existing_switch_away_from_its_default(option, monkeypatch):
    """``--kernel-options``: every option names a switch its module has, and sets another value than the
    module's default (an option that reaches nothing, or sets the default, would time the default twice)."""
    import importlib

    module_name, switch, value = bench.KERNEL_OPTIONS[option]
    module = importlib.import_module(module_name)
    default = getattr(module, switch)
    assert default != value
    monkeypatch.setattr(module, switch, default)  # restored after the test
    bench.apply_kernel_options([option])
    assert getattr(module, switch) == value


def test_routed_weight_bytes_count_the_experts_a_batch_routes_to():
    from torch import nn

    from portattn.models.layers import FusedMoE

    model, moe = nn.Module(), nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens, model.lm_head = nn.Embedding(10, 16), nn.Linear(16, 10, bias=False)
    moe.top_k, moe.experts = 2, FusedMoE(8, 16, 24)
    model.model.layers = nn.ModuleList([moe])
    every = bench.weight_bytes(model)
    per_expert = (2 * 24 * 16 + 16 * 24) * 4
    assert bench.routed_weight_bytes(model, 1) == pytest.approx(every - 6 * per_expert)  # its 2 of 8 experts
    assert bench.routed_weight_bytes(model, 3) == pytest.approx(every - 8 * 0.75**3 * per_expert)
    assert bench.routed_weight_bytes(model, 1000) == pytest.approx(every)
    del moe.top_k
    moe.gate = nn.Module()
    moe.gate.top_k = 4  # the router's (DeepSeek V3's)
    assert bench.routed_weight_bytes(model, 1) == pytest.approx(every - 4 * per_expert)
    moe.experts = nn.Linear(2, 2)
    assert bench.routed_weight_bytes(model, 1) is None  # no experts


def test_notes_targets_and_plot(tmp_path):
    rows = [
        {
            "batch": 1,
            "context": 1024,
            "limit_ms": 4.0,
            "limit_spec_ms": 3.5,
            "async_step_ms": 4.2,
            "async_vs_limit": 1.05,
            "graphs_step_ms": 4.4,
            "graphs_vs_limit": 1.1,
            "graphs_vs_spec": 1.26,
            "graphs_replay_ms": 4.1,
            "graphs_sampled_step_ms": 4.5,
        },
        {"batch": 64, "context": 1024, "limit_ms": 5.0, "graphs_step_ms": 7.5, "graphs_vs_limit": 1.5},
    ]
    results = {
        "copy": {"copy_tb_s": 4.3, "matmul_tflop_s": 780},
        "decode": {"model": "llama3-8b", "layers": 32, "rows": rows},
        "throughput": {"requests": 512, "prompt_len": 1024, "output_len": 256, "seconds": 50.0,
                       "output_tokens_per_s": 2600.0, "total_tokens_per_s": 13000.0, "steps": 300,
                       "replayed_steps": 250, "preemptions": 0,
                       "prefill_steps": {"steps": 40, "seconds": 20.0, "ms_per_step": 500.0, "tokens_per_step": 16400.0,
                                         "sequences_per_step": 80.0}},
        "hf": {"requests": 128, "batch": 64, "output_tokens_per_s": 400.0},
        "hf-compile": {"requests": 128, "batch": 64, "error": "RuntimeError: no"},
        # What main() writes: the part's rows and its part_seconds (a float beside the runs).
        "coldstart": {"runs": {"bfloat16": {"import_torch_s": 6.0, "import_s": 1.5, "construct_and_first_token_s": 18.5,
                                            "construct_s": 14.5, "first_token_s": 2.5, "graphs_at_start": 11,
                                            "triton_compiles": 14, "longest_compile_s": 3.25,
                                            "longest_compile": "attn_kernel"},
                               "bfloat16-lazy": {"construct_and_first_token_s": 30.0, "construct_s": 25.0},
                               "bfloat16-pyc-warm": {"import_torch_s": 1.0, "construct_and_first_token_s": 9.0,
                                                     "triton_cache_warm": True},
                               "float32": {"error": "no first token in 400 s"},
                               "float32-lazy": {"construct_and_first_token_s": 40.0, "longest_compile_s": 31.0,
                                                "longest_compile": "gemm"}},
                      "part_seconds": 80.5},
    }  # fmt: skip
    text = bench.notes(results)
    assert "| 1 | 4.00 / 3.50 | 4.20 | 1.05 | 4.40 | 1.10 / 1.26 | 4.10 |" in text
    assert (
        "batch-1 decode step with async scheduling 1.05x, synchronously 1.10x the streaming limit at the copy "
        "bandwidth, 1.26x at 4.8 TB/s (target <= 1.2x): met" in text
    )
    assert "| 64 | 5.00 / - | - | - | 7.50 |" in text  # no async row: the synchronous step decides
    assert (
        "batch-64 decode step synchronously 1.50x the streaming limit at the copy bandwidth (target <= 1.3x): not met"
        in text
    )
    assert "offline throughput 13,000 total tokens/s (target >= 30,000): not met" in text
    assert (
        "prefill steps (any prompt chunk): 40 in 20.0 s, 500.0 ms a step, 16400 tokens of 80 sequences a step." in text
    )
    assert "transformers static cache + compile: did not run (RuntimeError: no)" in text
    assert "| bfloat16 | 6.0 / 1.5 | 14.5 | 11 | 2.5 | 18.5 / 24.5 | - | 14 | 3.2 attn_kernel |" in text
    # the whole fresh process counts: torch's import too
    assert "bfloat16 cold start to the first token 24.5 s with torch's import (target <= 25 s): met" in text
    assert "bfloat16-lazy cold start to the first token 30.0 s with torch's import (target <= 25 s): not met" in text
    # a restart on a warm Triton cache: reported, not held to the cold start's target
    assert "- bfloat16-pyc-warm start on a warm Triton cache to the first token 10.0 s with torch's import\n" in text
    assert "bfloat16-pyc-warm cold start" not in text
    assert "float32-lazy: longest Triton compile 31.0 s, gemm (target <= 30 s): not met" in text
    assert "| float32 | failed: 'no first token in 400 s' |" in text
    assert "import of portattn's LLM 1.5 s on top of torch's 6.0 s (target <= 2 s): met" in text
    path = bench.plot(tmp_path, results)  # decode, cold start and throughput panels
    assert path == tmp_path / "engine_gpu.png" and path.stat().st_size > 10_000
    assert bench.plot(tmp_path, {"copy": results["copy"]}) is None  # nothing to draw


def test_a_coldstart_run_writes_its_notes(tmp_path, monkeypatch):
    """``--parts coldstart`` alone: the part's JSON (with its part_seconds), the notes and the plot,
    also beside the older layout of a cold-start file keyed by dtype."""
    row = {"dtype": "bfloat16", "import_s": 1.0, "construct_s": 9.0, "first_token_s": 1.0,
           "construct_and_first_token_s": 11.0}  # fmt: skip
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "part_coldstart", lambda args, results: {"runs": {"bfloat16": dict(row)}})
    monkeypatch.setitem(bench.PART_RUNNERS, "coldstart", bench.part_coldstart)
    assert bench.main(["--parts", "coldstart", "--out", str(tmp_path), "--workdir", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "engine_coldstart.json").read_text())
    assert saved["runs"]["bfloat16"] == row and saved["part_seconds"] >= 0
    assert "| bfloat16 | - / 1.0 | 9.0 |" in (tmp_path / "engine_gpu.md").read_text()
    assert (tmp_path / "engine_gpu.png").exists()
    (tmp_path / "engine_coldstart.json").write_text(json.dumps({"bfloat16": row, "part_seconds": 3.0}))
    assert "| bfloat16 | - / 1.0 | 9.0 |" in bench.notes(bench.load_results(tmp_path))


@pytest.mark.parametrize("family", ["llama4", "deepseek_v3"])
def test_random_checkpoints_of_moe_families_load(family, tmp_path):
    """Tensor names as save_pretrained writes them (DeepSeek V3: one tensor per expert and projection)."""
    from portattn.engine.llm import LLM
    from portattn.testing.checkpoints import tiny_config

    path = write_random_checkpoint(tiny_config(family), tmp_path / family, device="cpu")
    llm = LLM(str(path), page_size=4, num_pages=64, max_model_len=256, max_num_seqs=2)
    out = llm.generate([[3, 4, 5]], use_tqdm=False)[0]
    assert len(out.token_ids) > 0


def test_cascade_point_times_each_mode_as_it_says(tmp_path, cpu):
    """Graphs (the static path here) and eager attend plainly, the cascade mode cascades every step, the
    default rule none at this size; the notes table has the row."""
    from portattn.engine.llm import LLM

    path = write_random_checkpoint(tiny_llama(), tmp_path / "ckpt", device="cpu")
    llm = LLM(
        str(path), page_size=4, num_pages=128, max_model_len=256, max_num_seqs=4, enforce_eager=True,
        enable_cascade_attn=True,
    )  # fmt: skip
    llm.engine.runner.enable_graphs((1, 2, 4), capture=False).capture_all()
    row = bench.cascade_point(llm, batch=4, shared=32, own=5, steps=3)
    modes = ("graphs", "cascade_graphs", "eager", "cascade", "auto")
    assert [row[f"{mode}_cascades"] for mode in modes] == [0, 1, 0, 1, 0]
    assert row["rule_saved_bytes"] == 3 * 32 * llm.engine.runner.cascade_rule.bytes_per_token
    assert not llm.engine.requests
    text = bench.notes({"cascade": {"model": "tiny", "layers": 2, "rule": "r", "rows": [row]}})
    assert "| 4 | 32 | 5 |" in text


def test_throughput_part_runs_the_model_it_is_given(tmp_path, cpu):
    """``--model PATH``: the offline job on that checkpoint (SmolLM2's GGUF file on a GPU), named in
    the results and kept out of the Llama-3-8B target's line; ``--quantization fp8`` builds its engine so."""
    import argparse

    path = write_random_checkpoint(tiny_llama(), tmp_path / "given", device="cpu")
    args = argparse.Namespace(
        layers=2, workdir=tmp_path / "unused", max_num_seqs=2, prompt_len=12, output_len=3, kv_gib=1,
        chunked_prefill=64, async_scheduling=False, requests=3, profile_steps=False, model=str(path),
        quantization="fp8",
    )  # fmt: skip
    out = bench.part_throughput(args, {})
    assert out["model"] == "given" and out["requests"] == 3 and out["steps"] > 0
    (llm,) = bench._BUILT.values()  # --quantization reached the engine
    assert llm.engine.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert not (tmp_path / "unused").exists()  # no Llama-3-8B-shaped checkpoint written
    assert not any("offline throughput" in line for line in bench.targets({"throughput": out}))


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # the CPU's profile: no device kernels
def test_throughput_part_times_its_steps_by_kind(tmp_path, cpu, monkeypatch):
    """The offline job's synchronous steps split into steps with a prompt chunk and decode-only steps
    that account for every step and every computed token; the profile finds its two steps."""
    import argparse
    import functools

    monkeypatch.setattr(bench, "llama3_8b_config", lambda layers: tiny_llama())
    monkeypatch.setattr(bench, "profile_steps", functools.partial(bench.profile_steps, prefill_index=1))
    args = argparse.Namespace(
        layers=2, workdir=tmp_path, max_num_seqs=4, prompt_len=40, output_len=5, kv_gib=1, chunked_prefill=64,
        async_scheduling=False, requests=6, profile_steps=True, model=None, quantization=None,
    )  # fmt: skip
    out = bench.part_throughput(args, {})
    assert out["model"] == "llama3-8b"  # the random Llama-3-8B-shaped checkpoint (here its tiny stand-in)
    prefill, decode = out["prefill_steps"], out["decode_steps"]
    assert prefill["steps"] + decode["steps"] == out["steps"]
    computed = prefill["steps"] * prefill["tokens_per_step"] + decode["steps"] * decode["tokens_per_step"]
    assert round(computed) == args.requests * (args.prompt_len + args.output_len - 1)  # the last id is not fed back
    assert decode["tokens_per_step"] == decode["sequences_per_step"] and prefill["tokens_per_step"] <= 64
    # the requests checked and queued before the first step: part of the job's time, less than all of it
    assert 0 < out["queue_seconds"] < out["seconds"] - prefill["seconds"] - decode["seconds"] + 1e-3
    profiled = out["profile"]
    assert profiled["prefill"]["tokens"] > profiled["prefill"]["sequences"]  # the second step with a prompt chunk
    assert profiled["decode"]["tokens"] == profiled["decode"]["sequences"] == args.max_num_seqs  # the full batch


def test_cold_runs_record_each_compile_and_skip_cache_hits(monkeypatch):
    """The cold child's compile record: Triton's listener gives each compile's times; hits are not compiles."""
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(knobs.compilation, "listener", None)
    compiles = bench._record_compiles()
    listener = knobs.compilation.listener
    times = knobs.CompileTimes(ir_initialization=500_000, lowering_stages=[("ttir", 250_000), ("ptx", 1_000_000)],
                               store_results=0)  # fmt: skip
    listener(src=None, metadata={"name": "attn_kernel"}, metadata_group={}, times=times, cache_hit=False)
    listener(src=None, metadata={"name": "norm_kernel"}, metadata_group={}, times=times, cache_hit=True)
    assert compiles == [(1.75, "attn_kernel")]
    timed = bench._record_compiles(start=time.perf_counter() - 3.0)  # with when each compile ended
    knobs.compilation.listener(src=None, metadata={"name": "attn_kernel"}, metadata_group={}, times=times,
                               cache_hit=False)  # fmt: skip
    assert len(timed) == 1 and timed[0][:2] == (1.75, "attn_kernel") and 3.0 <= timed[0][2] < 60


def test_a_cold_run_with_cached_bytecode_writes_it_first_then_times_a_fresh_triton_cache(monkeypatch, tmp_path):
    """``-pyc``: an untimed run writes Python's bytecode (PYTHONDONTWRITEBYTECODE dropped, a cache prefix set),
    then the timed run reads it with an empty Triton cache; without the flag one run, the environment as it is."""
    import subprocess
    import types
    from pathlib import Path

    calls = []

    def fake_run(command, env, **kwargs):
        cache = Path(env["TRITON_CACHE_DIR"])
        calls.append((command[-1], dict(env), sorted(p.name for p in cache.iterdir())))
        (cache / "compiled").write_text("")  # a compile of this run
        row = {"dtype": command[-2]}
        return types.SimpleNamespace(stdout=json.dumps(row) + "\n", stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    args = types.SimpleNamespace(cold_timeout=10)
    row = bench._cold_run(args, str(tmp_path), "bfloat16-lazy-pyc")
    assert [c[0] for c in calls] == ["lazy", "lazy"] and row["bytecode_cached"] and row["dtype"] == "bfloat16"
    for _, env, triton_files in calls:
        assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"]
        assert triton_files == []  # each run starts on an empty Triton cache
    assert calls[0][1]["PYTHONPYCACHEPREFIX"] == calls[1][1]["PYTHONPYCACHEPREFIX"]
    calls.clear()
    row = bench._cold_run(args, str(tmp_path), "float32")
    assert len(calls) == 1 and calls[0][0] == "eager" and calls[0][1]["PYTHONDONTWRITEBYTECODE"] == "1"
    assert not row["bytecode_cached"]
    calls.clear()
    row = bench._cold_run(args, str(tmp_path), "bfloat16-pyc-warm")  # a restart: the first run's compiles kept
    assert [c[2] for c in calls] == [[], ["compiled"]] and row["triton_cache_warm"] and row["bytecode_cached"]
    with pytest.raises(ValueError, match="flags among"):
        bench._cold_run(args, str(tmp_path), "bfloat16-hot")


def test_the_step_trace_runs_a_load_with_the_start_ups_objects_frozen(tmp_path, capsys, monkeypatch):
    """``benchmarks.step_trace`` on the CPU: a small burst's every step written, the first tokens and gaps as the
    serving benchmark reports them, and the objects alive before the load frozen during it (as the server keeps
    its start-up's), then unfrozen."""
    import gc
    import json

    from benchmarks import step_trace
    from portattn.testing import save_tiny_checkpoint

    model = save_tiny_checkpoint("llama", tmp_path / "m")
    frozen_during = []
    step = step_trace.time.perf_counter

    def counting_clock():  # (called inside the load)
        frozen_during.append(gc.get_freeze_count())
        return step()

    out = tmp_path / "trace.json"
    monkeypatch.setattr(step_trace.time, "perf_counter", counting_clock)
    argv = [model, "--burst", "3", "--input-len", "9", "--output-len", "4", "--device", "cpu", "--out", str(out)]
    assert step_trace.main(argv) == 0
    monkeypatch.undo()
    trace = json.loads(out.read_text())
    assert trace["gc_frozen_objects"] > 1000 and max(frozen_during) > 1000  # (frozen ones freed by refcount leave)
    assert gc.get_freeze_count() == 0
    assert sum(s["prompt_tokens"] for s in trace["steps"]) == 27 and sum(s["generated"] for s in trace["steps"]) == 12
    assert trace["latency"]["ttft"]["mean_ms"] > 0 and "engine alone: TTFT mean" in capsys.readouterr().out
