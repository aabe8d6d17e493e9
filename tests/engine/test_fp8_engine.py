"""The engine with an fp8 KV cache, on the tiny families (Llama, Qwen2, Qwen3, Llama 4, DeepSeek V3's
latent cache), float32 models on the CPU.

Two questions, kept apart:

* Is the fp8 path right? The fp8 engine must give the same logits as the float32-cache engine whose
  cache writes are rounded through fp8 (quantise, then dequantise: the very values the fp8 cache
  holds), to float32 rounding, at every decode position (teacher-forced, one token per forward) and
  over whole prompts (DeepSeek's expanded prefill reads the latent rows back).
* What does fp8 cost? Against the float32-cache engine, top-1 agreement and logit errors over
  every decode position of the reference's greedy continuations. Random tiny models amplify any
  perturbation (their bf16 engine agrees with their float32 engine on 87-96% of positions), so the
  thresholds below come from a measurement (printed by the test) with a margin, not from theory.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import portattn.backends.base
from models.test_deepseek_v3 import checkpoint as deepseek_checkpoint
from portattn.backends import registry
from portattn.backends.base import AttentionBackend
from portattn.backends.torch_ref import TorchBackend
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.errors import UnsupportedFeatureError
from portattn.kv_quant import dequantize_kv, quantize_kv
from tiny_models import ENGINE_DEVICE, PARITY_FAMILIES, checkpoint, guard_decode_forwards, random_prompts

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PROMPTS = random_prompts([3, 9, 17, 30], seed=5)
NUM_DECODES = 48  # per prompt: 192 decode positions per family

# Measured (4 prompts x 48 positions): top-1 agreement with the float32-cache engine, and mean
# |logit error| / mean |logit|:
#            llama         qwen2         qwen3         llama4        deepseek
#   e4m3     0.86 / 0.091  0.90 / 0.103  0.93 / 0.055  0.85 / 0.117  0.71 / 0.207
#   e5m2     0.75 / 0.186  0.80 / 0.191  0.87 / 0.118  0.69 / 0.247  0.60 / 0.326
#            qwen2_moe     qwen3_moe     mixtral       (softmax-routed experts: a routing flip on a
#   e4m3     0.80 / 0.150  0.81 / 0.124  0.86 / 0.131   perturbed hidden state moves a tiny model's
#   e5m2     0.58 / 0.310  0.74 / 0.212  0.63 / 0.306   logits the most)
ROUTED = {"qwen2_moe", "qwen3_moe", "mixtral"}
MOE = ROUTED | {"llama4", "gpt_oss", "deepseek"}
MIN_AGREEMENT = {"fp8_e4m3": 0.75, "fp8_e5m2": 0.6}
MAX_MEAN_ERROR = {"fp8_e4m3": 0.15, "fp8_e5m2": 0.3}
ROUTED_MIN_AGREEMENT = {"fp8_e4m3": 0.75, "fp8_e5m2": 0.5}
ROUTED_MAX_MEAN_ERROR = {"fp8_e4m3": 0.2, "fp8_e5m2": 0.35}
DEEPSEEK_MIN_AGREEMENT = {"fp8_e4m3": 0.6, "fp8_e5m2": 0.5}  # its latent scores amplify the most
DEEPSEEK_MAX_MEAN_ERROR = {"fp8_e4m3": 0.3, "fp8_e5m2": 0.45}
EXACT = 1e-5  # fp8 engine vs rounded float32 cache: the scales' folding, float32 rounding only


def path_of(family: str, root: str) -> str:
    return deepseek_checkpoint("yarn", root) if family == "deepseek" else checkpoint(family, root)


def make_llm(path: str, kv_cache_dtype: str = "auto", *, decode_steps: bool = True, **kwargs) -> LLM:
    """``decode_steps``: one token per forward, so every position of a prompt is attended as a decode."""
    return LLM(
        path,
        page_size=7,
        num_pages=64,
        max_model_len=256,  # the DeepSeek checkpoint's max_position_embeddings
        max_num_seqs=8,
        kv_cache_dtype=kv_cache_dtype,
        chunked_prefill_size=1 if decode_steps else None,
        device=ENGINE_DEVICE,
        **kwargs,
    )


# The engines' options for the exact comparison: on a GPU the Triton backend splits and tiles an fp8
# cache's keys otherwise than a float32 cache's (another summation order: 2e-5 to 2e-4 of the largest
# logit measured on an H200), so the exact comparison takes the torch backend, whose attention sums the
# same way over either cache; the Triton engine is then held to SUMMATION against the rounded cache on its
# own backend, except where experts are routed by a top-k (a difference in the last bit picks another
# expert). The kernels' fp8 reads are compared with the float64 reference in tests/kernels.
EXACT_OPTIONS = {"attention_backend": "torch"} if ENGINE_DEVICE != "cpu" else {}
SUMMATION = 1e-3


@functools.cache
def reference(path: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The float32-cache engine's greedy continuations: (prompt + continuation, logits of each step)."""
    outs = make_llm(path, decode_steps=False).generate(
        PROMPTS,
        SamplingParams(temperature=0, max_tokens=NUM_DECODES, ignore_eos=True, return_logits=True),
        use_tqdm=False,
    )
    return [p + o.token_ids[:-1] for p, o in zip(PROMPTS, outs)], [o.logits for o in outs]


def prompt_logits(llm: LLM, seqs: list[list[int]]) -> list[torch.Tensor]:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, return_prompt_logits=True)
    return [out.prompt_logits for out in llm.generate(seqs, params, use_tqdm=False)]


def rounded_through(monkeypatch, kv_dtype: torch.dtype, scale: float) -> None:
    """Make the float32-cache engine store what an fp8 cache at ``scale`` stands for."""

    def write(x, cache_dtype, _scale=1.0):
        return dequantize_kv(quantize_kv(x, kv_dtype, scale), scale, cache_dtype)

    monkeypatch.setattr(portattn.backends.base, "quantize_kv", write)  # the backend: the one writer
    # Fused launches that store a cache of the queries' dtype themselves (the Triton backend's rotary
    # write, its one-launch write_kv) would store the values unrounded: the engine takes the base class's
    # write_kv instead, as over an fp8 cache.
    for cls in filter(None, map(registry.backend_class, registry.registered_backends())):
        for name in ("forward_rotary", "forward_projected", "write_latent_rotary", "write_kv"):
            monkeypatch.setattr(cls, name, getattr(AttentionBackend, name))


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


@pytest.mark.parametrize("kv", list(FP8))
@pytest.mark.parametrize("family", [*PARITY_FAMILIES, "deepseek"])
def test_fp8_engine_equals_the_rounded_cache_and_agrees_with_float32(family, kv, ckpt_root, monkeypatch):
    path = path_of(family, ckpt_root)
    seqs, ref_logits = reference(path)
    llm = make_llm(path, kv)
    assert llm.engine.kv_pool.dtype == FP8[kv]
    got = prompt_logits(llm, seqs)  # the default backend's: the quality check below
    exact = prompt_logits(make_llm(path, kv, **EXACT_OPTIONS), seqs) if EXACT_OPTIONS else got
    with monkeypatch.context() as patch:
        rounded_through(patch, FP8[kv], 1.0)
        want = prompt_logits(make_llm(path, **EXACT_OPTIONS), seqs)
        if EXACT_OPTIONS and family not in MOE:
            assert rel_err(got, prompt_logits(make_llm(path), seqs)) < SUMMATION
    assert rel_err(exact, want) < EXACT

    # Quality: the decode positions' logits against the float32 cache's.
    decoded = [g[len(p) - 1 :] for g, p in zip(got, PROMPTS)]  # logits that predict each continuation token
    agree = sum(int((d.argmax(-1) == r.argmax(-1)).sum()) for d, r in zip(decoded, ref_logits))
    total = sum(r.shape[0] for r in ref_logits)
    mean_err = float(sum((d - r).abs().sum() for d, r in zip(decoded, ref_logits)))
    mean_err /= float(sum(r.abs().sum() for r in ref_logits))
    print(f"{family} {kv}: top-1 agreement {agree}/{total}, mean |error| / mean |logit| {mean_err:.3f}")
    if family == "deepseek":
        min_agreement, max_error = DEEPSEEK_MIN_AGREEMENT, DEEPSEEK_MAX_MEAN_ERROR
    elif family in ROUTED:
        min_agreement, max_error = ROUTED_MIN_AGREEMENT, ROUTED_MAX_MEAN_ERROR
    else:
        min_agreement, max_error = MIN_AGREEMENT, MAX_MEAN_ERROR
    assert agree / total >= min_agreement[kv]
    assert mean_err <= max_error[kv]


@pytest.mark.parametrize("kv", list(FP8))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_v_cache_with_its_keys_contiguous_gives_the_usual_layouts_logits(family, kv, ckpt_root, monkeypatch):
    """``runtime.kv_cache.FP8_V_KEYS_CONTIGUOUS``: the pool stores each page's V keys contiguous; the
    write goes through its strides and the attention reads the same values: the same logits at every
    decode position and over whole prompts, bit for bit on the CPU (on a GPU the Triton backend's decode
    tiles differ by layout, another summation order: within ``SUMMATION``)."""
    from portattn.runtime import kv_cache

    path = path_of(family, ckpt_root)
    seqs, _ = reference(path)
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(kv_cache, "FP8_V_KEYS_CONTIGUOUS", on)
        for decode_steps in (True, False):
            llm = make_llm(path, kv, decode_steps=decode_steps)
            assert (llm.engine.kv_pool.v[0].stride(1) == 1) == on
            logits[on, decode_steps] = prompt_logits(llm, seqs)
    for decode_steps in (True, False):
        got, want = logits[True, decode_steps], logits[False, decode_steps]
        if ENGINE_DEVICE == "cpu":
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        else:
            assert rel_err(got, want) < SUMMATION


@pytest.mark.parametrize("family", ["qwen3", "deepseek"])
def test_fp8_prefill_over_whole_prompts(family, ckpt_root, monkeypatch):
    """Whole prompts in one forward: the cache is written and read back in the same step (DeepSeek:
    the expanded form dequantises the latent rows it gathers)."""
    path = path_of(family, ckpt_root)
    seqs, _ = reference(path)
    got = prompt_logits(make_llm(path, "fp8_e4m3", decode_steps=False), seqs)
    with monkeypatch.context() as patch:
        rounded_through(patch, torch.float8_e4m3fn, 1.0)
        want = prompt_logits(make_llm(path, decode_steps=False), seqs)
    assert rel_err(got, want) < EXACT


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_checkpoint_scales_are_read_and_applied(family, ckpt_root, tmp_path, monkeypatch):
    """A checkpoint with ``self_attn.kv_scale`` tensors: the pool holds them and every write and read
    uses them (a scale left out on either side changes the logits by orders of magnitude)."""
    source = path_of(family, ckpt_root)
    scale = 1 / 32  # stored values 32x the keys: the scale must be undone on every read
    source_dir = Path(source)
    for file in source_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(source_dir / "model.safetensors")
    num_layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    weights |= {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(scale) for i in range(num_layers)}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})

    llm = make_llm(str(tmp_path), "fp8_e4m3")
    assert [llm.engine.kv_pool.kv_scales(i) for i in range(num_layers)] == [(scale, scale)] * num_layers
    seqs = [s[:24] for s in reference(source)[0]]
    got = prompt_logits(llm, seqs)
    with monkeypatch.context() as patch:
        rounded_through(patch, torch.float8_e4m3fn, scale)
        want = prompt_logits(make_llm(str(tmp_path)), seqs)
    assert rel_err(got, want) < EXACT
    assert make_llm(str(tmp_path)).engine.kv_pool.kv_scales(0) == (1.0, 1.0)  # a float32 cache ignores them


class NoFp8Backend(TorchBackend):
    name = "no_fp8_engine"
    capabilities = dataclasses.replace(TorchBackend.capabilities, kv_dtypes=frozenset())


def test_a_backend_without_fp8_is_refused_at_start_up(ckpt_root, monkeypatch):
    entry = registry._Entry("no_fp8_engine", f"{__name__}:NoFp8Backend")
    monkeypatch.setitem(registry._REGISTRY, "no_fp8_engine", entry)
    try:
        with pytest.raises(UnsupportedFeatureError, match=r"does not support a KV cache of dtype torch\.float8_e5m2"):
            LLM(checkpoint("qwen3", ckpt_root), kv_cache_dtype="fp8_e5m2", attention_backend="no_fp8_engine")
    finally:
        registry._CLASSES.pop("no_fp8_engine", None)
        registry._INSTANCES.pop("no_fp8_engine", None)
    with pytest.raises(ValueError, match=r"expected kv_cache_dtype in \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\]"):
        LLM(checkpoint("qwen3", ckpt_root), kv_cache_dtype="int8")


def test_generate_takes_the_kv_cache_dtype_flag(ckpt_root, capsys):
    from portattn.cli import main

    path = checkpoint("qwen3", ckpt_root)
    argv = ["generate", "--model", path, "--prompt-ids", "0,5,9,200", "--max-tokens", "4", "--ignore-eos"]
    assert main([*argv, "--kv-cache-dtype", "fp8_e4m3", "--page-size", "3"]) == 0
    assert "output ids: [" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3", "deepseek"])
def test_fp8_decode_forwards_do_not_sync(family, ckpt_root):
    """Saturating writes, scales and fp8 reads add no device-to-host read to a decode step (eager: a
    captured graph's replay calls no forward to guard)."""
    llm = make_llm(path_of(family, ckpt_root), "fp8_e5m2", decode_steps=False, enforce_eager=True)
    decodes = guard_decode_forwards(llm)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert decodes and max(decodes) == 2


def test_the_engine_plans_by_its_cache_dtype(ckpt_root, monkeypatch):
    """The engine tells the backend its cache's dtype when it plans a step and when it plans a graph's
    shape (fp8 decodes split more)."""
    # graphs enabled by hand below, stepped synchronously (asynchronous steps need graphs made to take
    # the previous step's ids)
    llm = make_llm(path_of("qwen3", ckpt_root), "fp8_e4m3", decode_steps=False, async_scheduling=False)
    backend, seen = llm.engine.runner.backend, []
    plan, graph_metadata = backend.plan, backend.graph_metadata
    monkeypatch.setattr(backend, "plan", lambda batch, **kw: seen.append(("plan", kw["kv_dtype"])) or plan(batch, **kw))
    monkeypatch.setattr(
        backend,
        "graph_metadata",
        lambda *args, **kw: seen.append(("graph", kw["kv_dtype"])) or graph_metadata(*args, **kw),
    )
    llm.engine.runner.enable_graphs((1, 2), capture=False).capture_all()
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert {kind for kind, _ in seen} == {"plan", "graph"}
    assert {dtype for _, dtype in seen} == {torch.float8_e4m3fn}
