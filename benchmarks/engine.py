"""The engine on a GPU: ``python -m benchmarks.engine [--parts P ...] [--out DIR]``.

Builds full-size checkpoints with random bf16 weights in a temporary folder (no network needed) and
measures, in one run, the parts asked for (each writes ``engine_<part>.json`` to ``--out``; the
notes ``engine_gpu.md`` and the plot ``engine_gpu.png`` cover every part found there):

* ``copy``: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate;
* ``decode``: a Llama-3-8B-shaped model (``--layers``, 32) decoding batches of 1, 8, 32, 64, 128
  sequences at ``--context`` (1024) tokens, captured graphs and eager: wall time per engine step,
  the graph replay alone (the GPU's busy time, the step's plan included), host planning time (with
  graphs: the inputs written and copied), the same batch sampling (top-k, top-p) with the draw graph
  alone, against the streaming limit ``(weights read per step + KV read) /
  bandwidth`` at the measured copy bandwidth and at the specified 4.8 TB/s;
* ``launches``: kernels per layer of one eager decode step and of one replay (torch.profiler);
* ``throughput``: offline generation of 512 requests of 1024 prompt + 256 output tokens (``--model PATH``:
  of that checkpoint or GGUF file instead of the Llama-3-8B shape, e.g. SmolLM2-135M's 512 x (512 + 128)
  with ``--prompt-len 512 --output-len 128``), with the time from ``generate()`` to its first step (the
  requests checked and queued) and the prompt-chunk steps' share;
* ``hf`` / ``hf-compile``: the same requests (``--hf-requests`` of them) through transformers'
  ``generate`` on the same GPU, eager and with a static cache + ``torch.compile``;
* ``coldstart``: import, construction and first token in a fresh process with an empty Triton cache, per
  ``--cold-runs`` (bf16, bf16 with ``lazy_graph_capture``, fp32; ``-pyc``: with Python's bytecode cached as a
  pip install leaves it, which the GPU image's site-packages lack; ``-warm``: on the Triton cache an untimed run
  filled, a restart); ``PORTATTN_COLD_PROFILE=1`` adds the
  construction's cProfile (its functions by cumulative time: ``construct_profile``);
* ``cascade``: batches (``--cascade-batches``) decoding after a shared prefix (``--cascade-shared``
  tokens, then ``--cascade-own`` of each request's own): steps with graphs (plain attention), with
  the graphs' cascade shapes, eager plain, eager through a cascade, and as the engine's rule chooses
  (with ``enable_cascade_attn``; its graph bound comes from this table);
* ``llama4`` / ``deepseek``: a Llama 4-shaped model (chunked local layers, MoE) and a DeepSeek-V3-shaped
  one (MLA, grouped MoE), fewer layers and experts to fit, decoding with graphs and eagerly.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from portattn.device import synchronize
from portattn.quantization import QUANTIZATIONS

# Each option: (module, its switch, the value the option sets). "pages_ahead", "merge_in_kernel", "no_pdl",
# "no_short_splits": launch.py's switches; "unfused_linear": norms and activations in their own kernels at every
# batch; "unfused_rotary": the q/k/v projection, then the rotary + cache write launch; "cublas_down": the down
# projection through the vendor's matmul at small batches; "unfused_out_proj": the output projection after a split
# attention's merge, not in it; "no_short_shapes": every captured step planned for the longest context
# (engine/graphs.py); "no_row_linear": one-row projections through the vendor's matmul; "row_rotary": one-row q/k/v
# projections with the rotation and cache write; "two_block_gate_up": the gated MLP's weight as [gate; up] instead of
# alternating rows; "dense_experts": every expert on every token at small batches, not the routed experts alone;
# "two_block_experts": routed experts' gate/up as [gate; up] halves; "uncombined_experts": a token's routed experts
# weighed and summed by torch after the down projection; "unfused_pairs_rotary": Llama 4's pair rotation and q/k norm
# through the torch code; "unfused_router": DeepSeek V3's grouped top-k through the torch code;
# "unfused_latent_rotary": MLA's rope through the torch code, then write_latent; "absorbed_value_rows": a one-token
# MLA step's value product through expert_rows; "unfused_llama4_router": Llama 4's router and attention temperature
# through the torch code; "fp8_dot_rows": quantization="fp8"'s steps of up to 16 rows in norm_linear's tensor-core
# tiles, not one-row steps in row_linear; "fp8_row_words": row_linear over fp8 weights read as words of four values
# (inline PTX), not in Triton's byte-wise tiles; "unfused_fp8_activation": quantization="fp8"'s gated activation
# written in the model dtype and quantized by the down projection, not quantized in the activation's launch;
# "unfused_fp8_norm": likewise the norms before the q/k/v and gate/up projections.
_LAUNCH, _FUSED_LAUNCH = "portattn.kernels.triton.launch", "portattn.kernels.triton.fused_launch"
_MOE, _LATENT = "portattn.models.layers.moe", "portattn.models.layers.latent_attention"
KERNEL_OPTIONS = {
    "pages_ahead": (_LAUNCH, "PAGES_AHEAD", True), "merge_in_kernel": (_LAUNCH, "MERGE_SPLITS_IN_KERNEL", True),
    "no_pdl": (_LAUNCH, "PDL", False), "no_short_splits": (_LAUNCH, "SHORT_DECODE_KEYS", 0),
    "unfused_linear": None, "unfused_rotary": None,
    "cublas_down": ("portattn.models.layers.linear", "SMALL_DOWN_PROJ", False),
    "unfused_out_proj": ("portattn.models.layers.attention", "FOLD_OUT_PROJ", False),
    "no_short_shapes": ("portattn.engine.graphs", "SHORT_KEYS", 0),
    "no_row_linear": (_FUSED_LAUNCH, "ROW_LINEAR_K", 1 << 62), "row_rotary": (_FUSED_LAUNCH, "ROW_LINEAR_ROTARY", True),
    "two_block_gate_up": ("portattn.models.layers.mlp", "GATE_UP_INTERLEAVED", False),
    "dense_experts": (_MOE, "ROUTED_EXPERTS", False), "two_block_experts": (_MOE, "EXPERTS_INTERLEAVED", False),
    "uncombined_experts": (_MOE, "COMBINE_IN_KERNEL", False),
    "unfused_pairs_rotary": ("portattn.models.llama4", "FUSED_ROTARY_PAIRS", False),
    "unfused_router": ("portattn.models.deepseek_v3", "FUSED_ROUTER", False),
    "unfused_llama4_router": ("portattn.models.llama4", "FUSED_ROUTER", False),
    "unfused_latent_rotary": (_LATENT, "FUSED_ROTARY_WRITE", False),
    "unfolded_latent_norm": (_LATENT, "FOLD_LATENT_NORM", False),
    "absorbed_value_rows": (_LATENT, "ABSORBED_VALUE_ROWS", True),
    "no_repeat_launch": (_LAUNCH, "REPEAT_LAUNCHES", False),
    "no_fast_launch": ("portattn.kernels.triton.fast_launch", "FAST", False),
    "fp8_dot_rows": ("portattn.models.layers.linear", "FP8_ROW_LINEAR", False),
    "fp8_row_words": (_FUSED_LAUNCH, "ROW_LINEAR_WORDS", True),
    "unfused_fp8_activation": ("portattn.models.layers.mlp", "QUANTIZE_IN_ACTIVATION", False),
    "unfused_fp8_norm": ("portattn.models.layers.decoder", "QUANTIZE_IN_NORM", False),
}  # fmt: skip
PARTS = ("copy", "decode", "launches", "throughput", "hf", "hf-compile", "coldstart", "cascade", "llama4", "deepseek")


def apply_kernel_options(options: list[str]) -> None:
    """Switch launch options away from their defaults for this process (``--kernel-options``)."""
    for option in options:
        if option == "unfused_linear":
            from portattn.models.layers.fused import set_fused_linear_rows

            set_fused_linear_rows(0)
        elif option == "unfused_rotary":  # the base class's answer: "not in one launch here"
            from portattn.backends.base import AttentionBackend
            from portattn.backends.triton import TritonBackend

            TritonBackend.forward_projected = AttentionBackend.forward_projected
        else:
            module, switch, value = KERNEL_OPTIONS[option]
            setattr(importlib.import_module(module), switch, value)


DEVICE = "cuda"  # tests run the measuring helpers on "cpu"
SPEC_TB_S = 4.8  # the H200's specified memory bandwidth, the second limit the targets are read against


# -- model shapes ------------------------------------------------------------------------------


def llama3_8b_config(layers: int):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001,
    )  # fmt: skip


def llama4_config(layers: int):
    """Llama 4 Scout's shapes with ``layers`` layers and 16 experts; chunks of 512 tokens, so that
    1k-token contexts cross chunk boundaries (Scout's is 8192)."""
    from transformers import Llama4TextConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    return Llama4TextConfig(
        vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
        num_hidden_layers=layers, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layer_interval=4,
        attention_chunk_size=512, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192,
        attn_scale=0.1, max_position_embeddings=16384, rope_parameters=rope, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip


def deepseek_v3_config(layers: int):
    """DeepSeek V3's shapes with ``layers`` layers (the first dense) and 32 routed experts in 8 groups."""
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096}
    rope |= {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True, rope_parameters=rope,
        max_position_embeddings=163840, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip


def checkpoint(name: str, config, workdir: Path) -> str:
    from .random_checkpoint import write_random_checkpoint

    start = time.perf_counter()
    path = write_random_checkpoint(config, workdir / name, device=DEVICE)
    print(f"[{name}] checkpoint ready in {time.perf_counter() - start:.1f} s: {path}", flush=True)
    return str(path)


def default_workdir() -> Path:
    shm = Path("/dev/shm")  # RAM-backed where there is one: writing and reading 16 GB takes seconds
    return Path(tempfile.gettempdir() if not shm.is_dir() else shm) / "portattn_bench_engine"


# -- measurements ------------------------------------------------------------------------------


def sync() -> None:
    synchronize(torch.device(DEVICE))


def weight_bytes(model) -> int:
    """Bytes one decode step reads of the weights: every parameter but the embedding table (of which it
    reads one row per token), the LM head included."""
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if lm_head.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def routed_weight_bytes(model, batch: int) -> float | None:
    """:func:`weight_bytes` with each mixture-of-experts layer's experts counted as many as a decode batch of
    ``batch`` tokens routes to: ``E (1 - (1 - k/E)^B)`` expected under uniform routing (``k`` at batch 1,
    nearly all ``E`` once ``B k`` is several times ``E``). None for a model without experts."""
    from portattn.models.layers.moe import FusedMoE

    total, found = float(weight_bytes(model)), False
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, FusedMoE):
            continue
        # the layer's own top_k (Llama 4, Qwen) or its router's (DeepSeek V3's gate)
        k = getattr(module, "top_k", None) or next((c.top_k for c in module.children() if hasattr(c, "top_k")), None)
        if k is None:
            raise ValueError(f"expected a top_k on {type(module).__name__} or its router")
        found = True
        count = experts.num_experts
        params = [experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias]
        per_expert = sum(p[0].numel() * p.element_size() for p in params if p is not None)
        total -= (count - count * (1 - (1 - k / count) ** batch)) * per_expert
    return total if found else None


def kv_bytes_per_token(engine) -> float:
    pool = engine.kv_pool
    return pool.spec.bytes_per_page(pool.page_size, pool.dtype) / pool.page_size


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (count, length), generator=g).tolist()


def event_time_ms(fn, repeats: int = 20) -> float:
    """Median device time of ``fn()`` between events (the device's own time; launches queued back to back)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        if DEVICE == "cpu":  # runs synchronously: wall time is its time
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_time_us(fn, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def start_decoding(engine, batch: int, context: int, max_tokens: int, seed: int = 0) -> list:
    """``batch`` requests with ``context``-token prompts, prefilled: the next steps are pure decodes."""
    from portattn.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(ids, params) for ids in random_prompts(batch, context, engine.vocab_size, seed)]
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        engine.step()
    return seqs


@torch.inference_mode()
def time_mode(engine, graphs, steps: int) -> dict:
    """Wall time per engine step; the host plan and the forward of the next step alone (decode)."""
    runner = engine.runner
    mode = "eager" if graphs is None else "graphs"
    runner.graphs = graphs
    row = {f"{mode}_step_ms": step_ms(engine, steps)}  # (its first, untimed step compiles this mode's kernels)
    scheduled = engine.scheduler.schedule()  # the next step (reserving is idempotent)
    if graphs is not None:
        row["graphs_plan_us"] = host_time_us(lambda: graphs.write_step(scheduled))
        # The decode graph: the model, the LM head and the argmax (what a greedy step replays).
        row["graphs_replay_ms"] = event_time_ms(graphs.graphs[graphs.write_step(scheduled)].replay)
        row["graphs_host_ms"] = row["graphs_step_ms"] - row["graphs_replay_ms"]
    else:
        row["eager_plan_us"] = host_time_us(lambda: runner.plan(scheduled))
        batch, ctx = runner.plan(scheduled)
        row["eager_forward_ms"] = event_time_ms(lambda: runner.model(batch.input_ids, batch.positions, ctx))
    return row


SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95, seed=1)  # the sampled decode steps' parameters
NUCLEUS = dict(temperature=0.6, top_p=0.9, seed=1)  # top_p alone (Llama 3's generation defaults): no sort


@torch.inference_mode()
def time_sampled(engine, graphs, seqs: list, steps: int, params: dict = SAMPLED, name: str = "sampled") -> dict:
    """Graph steps of the same batch sampling (``params``: :data:`SAMPLED`, or :data:`NUCLEUS` named
    ``nucleus``) instead of greedy: the step, and the draw graph alone (``graphs_<name>_step_ms``,
    ``graphs_<name>_draw_ms``; the sampled draw keeps round 2's names); the sequences are greedy
    again afterwards."""
    import dataclasses

    from portattn.engine.graph_sampling import Filters

    greedy = [seq.params for seq in seqs]
    for seq in seqs:
        seq.params = dataclasses.replace(seq.params, **params)
    try:
        sampled0 = graphs.sampled
        row = {f"graphs_{name}_step_ms": step_ms(engine, steps)}
        row[f"graphs_{name}_in_graph"] = (graphs.sampled - sampled0) / (steps + 1)
        filters = Filters(min_p=False, top_k="top_k" in params, top_p="top_p" in params)
        key = (graphs.bucket(len(seqs)), filters)
        if key in graphs.draw_graphs:
            row["graphs_draw_ms" if name == "sampled" else f"graphs_{name}_draw_ms"] = event_time_ms(
                graphs.draw_graphs[key].replay
            )
    finally:
        for seq, params in zip(seqs, greedy):
            seq.params = params
    return row


@contextlib.contextmanager
def synchronous(engine):
    """The engine's steps synchronous inside: a step launched ahead (async scheduling) is read first,
    and none is launched ahead until the block ends."""
    ahead = engine.run_ahead
    if ahead is not None:
        ahead.settle()
    engine.run_ahead = None
    try:
        yield
    finally:
        engine.run_ahead = ahead


def decode_point(llm, batch: int, context: int, steps: int, copy_tb_s: float) -> dict:
    """Step times of one decode batch: with async scheduling where the engine has it (the default on a
    GPU: ``async_step_ms``, each step launched before the previous one's tokens are read), then
    synchronous steps, graphs (greedy and sampled) and eager; every request is aborted afterwards.
    The limit: weights and KV read once per step at the measured copy bandwidth, and at the H200's
    specified 4.8 TB/s."""
    engine = llm.engine
    graphs = engine.runner.graphs
    seqs = start_decoding(engine, batch, context, max_tokens=5 * steps + 16)
    row: dict = {"batch": batch, "context": context}
    try:
        if engine.run_ahead is not None:
            row["async_step_ms"] = step_ms(engine, steps)
        with synchronous(engine):
            if graphs is not None:
                row |= time_mode(engine, graphs, steps)
                row |= time_sampled(engine, graphs, seqs, steps)
                row |= time_sampled(engine, graphs, seqs, steps, NUCLEUS, "nucleus")
            row |= time_mode(engine, None, steps)
    finally:
        engine.runner.graphs = graphs
    mean_context = context + (5 if "async_step_ms" in row else 4) * steps // 2
    weights = weight_bytes(engine.model)
    kv = batch * mean_context * kv_bytes_per_token(engine)
    row |= {"weight_bytes": weights, "kv_bytes": kv, "limit_ms": (weights + kv) / (copy_tb_s * 1e12) * 1e3}
    row["limit_spec_ms"] = (weights + kv) / (SPEC_TB_S * 1e12) * 1e3
    routed = routed_weight_bytes(engine.model, batch)
    if routed is not None:  # experts: the bytes of those the batch routes to
        row |= {"routed_weight_bytes": routed, "routed_limit_ms": (routed + kv) / (copy_tb_s * 1e12) * 1e3}
    if "graphs_step_ms" in row:
        row["graphs_vs_spec"] = row["graphs_step_ms"] / row["limit_spec_ms"]
    for seq in seqs:
        if seq.request_id in engine.requests:
            engine.abort(seq.request_id)
    for mode in ("async", "graphs", "eager"):
        if f"{mode}_step_ms" in row:
            row[f"{mode}_vs_limit"] = row[f"{mode}_step_ms"] / row["limit_ms"]
            if "routed_limit_ms" in row:
                row[f"{mode}_vs_routed_limit"] = row[f"{mode}_step_ms"] / row["routed_limit_ms"]
    print(f"[decode] {json.dumps(row)}", flush=True)
    return row


def step_ms(engine, steps: int) -> float:
    """Wall milliseconds per engine step over ``steps`` steps, after one untimed step."""
    engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps


@torch.inference_mode()
def cascade_point(llm, batch: int, shared: int, own: int, steps: int) -> dict:
    """Decode steps of ``batch`` requests that share a ``shared``-token prefix (cached before they
    start) and have ``own`` prompt tokens each: graphs with plain attention, graphs in their cascade
    shape, eager plain, eager through a cascade, and the rule's defaults (``auto``: what it chose is
    in ``auto_cascades``)."""
    import dataclasses

    from portattn.engine.sampling_params import SamplingParams

    engine = llm.engine
    runner = engine.runner
    graphs, rule = runner.graphs, runner.cascade_rule
    prefix = random_prompts(1, shared, engine.vocab_size, seed=shared)[0]
    llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 16, ignore_eos=True)
    tails = random_prompts(batch, own, engine.vocab_size, seed=batch + shared)
    seqs = [engine.add_request(prefix + tail, params) for tail in tails]
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        engine.step()
    always = dataclasses.replace(rule, min_batch=1, min_shared_tokens=1, min_shared_fraction=0.0,
                                 graph_min_saved_bytes=0, eager_min_saved_bytes=0)  # fmt: skip
    row: dict = {"batch": batch, "shared": shared, "own": own}
    with synchronous(engine):
        try:
            for mode, mode_graphs, mode_rule in (("graphs", graphs, None), ("cascade_graphs", graphs, always),
                                                 ("eager", None, None), ("cascade", None, always),
                                                 ("auto", graphs, rule)):  # fmt: skip
                runner.graphs, runner.cascade_rule = mode_graphs, mode_rule
                before = runner.cascade_steps
                row[f"{mode}_step_ms"] = step_ms(engine, steps)
                row[f"{mode}_cascades"] = (runner.cascade_steps - before) / (steps + 1)
        finally:
            runner.graphs, runner.cascade_rule = graphs, rule
    per_token = kv_bytes_per_token(engine)
    row["plain_kv_bytes"] = batch * (shared + own) * per_token
    row["cascade_kv_bytes"] = (shared + batch * own) * per_token
    row["rule_saved_bytes"] = (batch - 1) * shared * rule.bytes_per_token
    row["cascade_vs_graphs"] = row["graphs_step_ms"] / row["cascade_step_ms"]
    row["cascade_graphs_vs_graphs"] = row["graphs_step_ms"] / row["cascade_graphs_step_ms"]
    best = min(row["graphs_step_ms"], row["cascade_graphs_step_ms"], row["cascade_step_ms"])
    row["auto_vs_best"] = best / row["auto_step_ms"]
    for seq in seqs:
        if seq.request_id in engine.requests:
            engine.abort(seq.request_id)
    print(f"[cascade] {json.dumps(row)}", flush=True)
    return row


def count_kernels(fn, times: Counter | None = None) -> tuple[int, Counter]:
    """Device kernels (and copies) that ``fn()`` runs, by torch.profiler; their microseconds by name
    are added to ``times`` when given."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if times is not None:
        for e in kernels:
            times[e.name] += e.time_range.elapsed_us()
    names = Counter(e.name for e in kernels)
    return sum(names.values()), names


_BUILT: dict = {}  # the last engine built, reused by the next part that asks for the same one


def make_llm(path: str, dtype: str = "bfloat16", **kwargs):
    from portattn.engine.llm import LLM

    key = (path, dtype, tuple(sorted(kwargs.items())))
    if key in _BUILT:
        return _BUILT[key]
    _BUILT.clear()
    gc.collect()
    torch.cuda.empty_cache()
    start = time.perf_counter()
    llm = LLM(path, device=DEVICE, dtype=dtype, **kwargs)
    print(f"engine built in {time.perf_counter() - start:.1f} s", flush=True)
    _BUILT[key] = llm
    return llm


def decode_llm(args, path: str):
    """The engine of the decode and launches parts (one build serves both)."""
    kv = args.kv_gib << 30
    return make_llm(
        path, max_num_seqs=max(args.batches), max_model_len=args.context + 512, kv_cache_memory=kv,
        quantization=args.quantization,
    )  # fmt: skip


# -- parts -------------------------------------------------------------------------------------


def part_copy(args, results: dict) -> dict:
    from portattn.bench.ceilings import measure_ceilings

    ceilings = measure_ceilings(torch.device(DEVICE))
    return {"copy_tb_s": ceilings.copy_tb_s, "matmul_tflop_s": ceilings.matmul_tflop_s}


def copy_tb_s(args, results: dict) -> float:
    if "copy" not in results:
        results["copy"] = part_copy(args, results)
    return results["copy"]["copy_tb_s"]


def part_decode(args, results: dict) -> dict:
    bandwidth = copy_tb_s(args, results)
    path = checkpoint(f"llama3_8b_{args.layers}l", llama3_8b_config(args.layers), args.workdir)
    llm = decode_llm(args, path)
    rows = [decode_point(llm, b, args.context, args.steps, bandwidth) for b in args.batches]
    return {"model": "llama3-8b", "layers": args.layers, "copy_tb_s": bandwidth, "rows": rows}


@torch.inference_mode()
def part_launches(args, results: dict) -> dict:
    if args.launches_model == "llama3_8b":
        path = checkpoint(f"llama3_8b_{args.layers}l", llama3_8b_config(args.layers), args.workdir)
    else:  # the family part's checkpoint and layers
        config = (llama4_config if args.launches_model == "llama4" else deepseek_v3_config)(args.family_layers)
        path = checkpoint(f"{args.launches_model}_{args.family_layers}l", config, args.workdir)
        args = argparse.Namespace(**{**vars(args), "layers": args.family_layers})
    llm = decode_llm(args, path)
    engine, runner = llm.engine, llm.engine.runner
    with synchronous(engine):  # the next step planned here, none launched ahead
        return {"model": args.launches_model} | launches(args, engine, runner)


def launches(args, engine, runner) -> dict:
    from portattn.models.layers.fused import set_fused_kernels

    seqs = start_decoding(engine, 1, args.context, max_tokens=64)
    scheduled = engine.scheduler.schedule()
    batch, ctx = runner.plan(scheduled)
    out = {"layers": args.layers}
    try:
        set_fused_kernels(False)  # the layers' torch code: the count before fusion
        unfused, unfused_names = count_kernels(lambda: runner.model(batch.input_ids, batch.positions, ctx))
    finally:
        set_fused_kernels(True)
    out |= {"unfused_kernels": unfused, "unfused_per_layer": unfused / args.layers}
    out["unfused_top"] = unfused_names.most_common(25)
    eager, eager_names = count_kernels(lambda: runner.model(batch.input_ids, batch.positions, ctx))
    out |= {"eager_kernels": eager, "eager_per_layer": eager / args.layers}
    out["eager_top"] = eager_names.most_common(25)
    if runner.graphs is not None:
        graph = runner.graphs.graphs[(runner.graphs.bucket(1), 1)]  # (batch size, uniform_q_len)
        replay, replay_names = count_kernels(graph.replay)
        out |= {"replay_kernels": replay, "replay_per_layer": replay / args.layers}
        out["replay_top"] = replay_names.most_common(25)
        # Where a replay's device time goes, kernel by kernel (the buffers hold the last step's batch:
        # batch 1 as planned above; the larger buckets rows from the decode part's steps).
        out["replay_time_us"] = {}
        for size in sorted({1, 64, max(args.batches)} & set(runner.graphs.batch_sizes)):
            times: Counter = Counter()
            count_kernels(runner.graphs.graphs[(size, 1)].replay, times)
            out["replay_time_us"][size] = {
                "total": sum(times.values()),
                "top": [(name[:90], round(us, 1)) for name, us in times.most_common(14)],
            }
            top = ", ".join(f"{name[:40]} {us:.0f}" for name, us in times.most_common(6))
            print(f"[launches] replay at batch {size}: {sum(times.values()):.0f} us of kernels; {top}", flush=True)
    for seq in seqs:
        engine.abort(seq.request_id)
    print(f"[launches] {out['unfused_per_layer']:.1f} -> {out['eager_per_layer']:.1f} per layer", flush=True)
    return out


def part_throughput(args, results: dict) -> dict:
    from portattn.engine.sampling_params import SamplingParams

    if args.model:
        path, model = args.model, Path(args.model).name
    else:
        path, model = checkpoint(f"llama3_8b_{args.layers}l", llama3_8b_config(args.layers), args.workdir), "llama3-8b"
    llm = make_llm(
        path,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.prompt_len + args.output_len + 16,
        kv_cache_memory=args.kv_gib << 30,
        chunked_prefill_size=args.chunked_prefill,
        async_scheduling=args.async_scheduling,
        quantization=args.quantization,
    )
    prompts = random_prompts(args.requests, args.prompt_len, llm.engine.vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up: the same job on other prompts (no page of theirs in the prefix cache), untimed, so that
    # the kernels of its mixed prefill + decode steps compile outside the timed run, as on any run after
    # a machine's first (Triton keeps its compiles on disk); the cold start is the coldstart part's.
    warm = random_prompts(args.requests, args.prompt_len, llm.engine.vocab_size, seed=2)
    llm.generate(warm, params, use_tqdm=False)
    graphs = llm.engine.runner.graphs
    replays0 = graphs.replays if graphs is not None else 0
    steps = [0]
    engine = llm.engine
    step, run_step = engine.step, engine.run_step
    kinds = {}  # synchronous steps by kind: [steps, seconds, query tokens, sequences]
    last = []  # the running step's (query tokens, sequences), as run_step saw its schedule
    first_step = []  # when each step began (the first: after the requests were checked and queued)

    def counted():
        steps[0] += 1
        last.clear()
        start = time.perf_counter()
        first_step.append(start)
        finished = step()
        if last:  # a synchronous step: its wall time holds its forward, sampling and outputs
            tokens, seqs = last
            row = kinds.setdefault("decode" if tokens == seqs else "prefill", [0, 0.0, 0, 0])
            for i, value in enumerate((1, time.perf_counter() - start, tokens, seqs)):
                row[i] += value
        return finished

    def seen(scheduled):
        last[:] = [sum(n for _, n in scheduled), len(scheduled)]
        return run_step(scheduled)

    engine.step, engine.run_step = counted, seen
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    del engine.step, engine.run_step
    assert all(len(o.token_ids) == args.output_len for o in outs)
    out = {
        "model": model,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "seconds": seconds,
        "output_tokens_per_s": args.requests * args.output_len / seconds,
        "total_tokens_per_s": args.requests * (args.prompt_len + args.output_len) / seconds,
        "steps": steps[0],
        "replayed_steps": (graphs.replays - replays0) if graphs is not None else 0,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "async_scheduling": engine.run_ahead is not None,
        "queue_seconds": first_step[0] - t0,  # from generate() to the first step: checking and queueing
    }
    for kind, (n, secs, tokens, seqs) in kinds.items():  # "prefill": steps with any prompt chunk in them
        out[f"{kind}_steps"] = {"steps": n, "seconds": secs, "ms_per_step": secs / n * 1e3,
                                "tokens_per_step": tokens / n, "sequences_per_step": seqs / n}  # fmt: skip
    if args.profile_steps:
        fresh = random_prompts(args.max_num_seqs, args.prompt_len, llm.engine.vocab_size, seed=3)  # no cached page
        with synchronous(engine):
            out["profile"] = profile_steps(llm, args, fresh)
    print(f"[throughput] {json.dumps(out)}", flush=True)
    return out


def profile_steps(llm, args, prompts: list, prefill_index: int = 7, top: int = 14) -> dict:
    """Device kernels of one step with a prompt chunk (the ``prefill_index``-th; earlier requests'
    decodes ride along) and of one decode-only step of the full batch, by torch.profiler, in a short
    untimed job of ``prompts`` (a synchronous engine): per step its kernels' total microseconds, and the
    ``top`` kernel names by time with their counts."""
    from torch.profiler import ProfilerActivity, profile

    from portattn.engine.sampling_params import SamplingParams

    engine = llm.engine
    run_step = engine.run_step
    seen = {"prefill": 0, "decode": 0}
    result = {}

    def profiled(scheduled):
        tokens, seqs = sum(n for _, n in scheduled), len(scheduled)
        kind = "decode" if tokens == seqs else "prefill"
        wanted = seen[kind] == prefill_index if kind == "prefill" else seqs == len(prompts)
        seen[kind] += 1
        if kind in result or not wanted:
            return run_step(scheduled)
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            finished = run_step(scheduled)
            sync()
        times, counts = Counter(), Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name] += e.time_range.elapsed_us()
                counts[e.name] += 1
        result[kind] = {
            "tokens": tokens,
            "sequences": seqs,
            "kernel_us": sum(times.values()),
            "kernels": sum(counts.values()),
            "top": [[name[:80], us, counts[name]] for name, us in times.most_common(top)],
        }
        row = result[kind]
        names = ", ".join(f"{n[:48]} {us / 1e3:.1f} ms x{c}" for n, us, c in row["top"][:8])
        print(f"[profile] {kind} step of {tokens} tokens, {seqs} sequences: {row['kernel_us'] / 1e3:.1f} ms of "
              f"{row['kernels']} kernels; {names}", flush=True)  # fmt: skip
        return finished

    engine.run_step = profiled
    try:  # decodes long enough that the whole batch decodes together once every prompt is in
        tokens = 2 * (len(prompts) * args.prompt_len // args.chunked_prefill + 2)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    finally:
        del engine.run_step
    return result


def part_hf(args, results: dict, *, compiled: bool) -> dict:
    from transformers import AutoModelForCausalLM

    path = checkpoint(f"llama3_8b_{args.layers}l", llama3_8b_config(args.layers), args.workdir)
    _BUILT.clear()  # the GPU's memory for transformers' model
    gc.collect()
    torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    prompts = torch.tensor(random_prompts(args.hf_requests, args.prompt_len, model.config.vocab_size, seed=1))
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    if compiled:
        kwargs["cache_implementation"] = "static"
    out = {"requests": args.hf_requests, "batch": args.hf_batch, "compiled": compiled}

    def run(ids: torch.Tensor) -> None:
        ids = ids.to(DEVICE)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)

    try:
        t0 = time.perf_counter()
        run(prompts[: args.hf_batch])  # warm-up (compiles, with a static cache); not counted
        out["warmup_s"] = time.perf_counter() - t0
        sync()
        t0 = time.perf_counter()
        for start in range(0, args.hf_requests, args.hf_batch):
            run(prompts[start : start + args.hf_batch])
        sync()
        seconds = time.perf_counter() - t0
        out |= {"seconds": seconds, "output_tokens_per_s": args.hf_requests * args.output_len / seconds}
    except Exception as exc:  # reported in the results: transformers' compile path may not run here
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    print(f"[hf{'-compile' if compiled else ''}] {json.dumps(out)}", flush=True)
    return out


def part_coldstart(args, results: dict) -> dict:
    """``{"runs": {run: row}}``, one fresh process per run of ``--cold-runs`` (:func:`_cold_run`)."""
    path = checkpoint(f"llama3_8b_{args.layers}l", llama3_8b_config(args.layers), args.workdir)
    _BUILT.clear()  # the other parts' engine would hold the memory a fresh process sizes its cache from
    gc.collect()
    torch.cuda.empty_cache()
    runs = {}
    for run in args.cold_runs:
        runs[run] = _cold_run(args, path, run)
        print(f"[coldstart {run}] {json.dumps(runs[run])}", flush=True)
    return {"runs": runs}


COLD_FLAGS = {"lazy", "pyc", "warm"}


def _cold_run(args, path: str, run: str) -> dict:
    """One cold run (``DTYPE[-lazy][-pyc][-warm]``): a fresh process on an empty Triton cache; ``-lazy``: decode
    graphs captured when first used; ``-pyc``: Python's bytecode cached, as a pip install leaves it (written by an
    untimed first run of the same process; a machine that sets ``PYTHONDONTWRITEBYTECODE`` and has no
    ``__pycache__`` compiles every module's source in each process otherwise); ``-warm``: the Triton cache that
    untimed first run filled is kept (a restart)."""
    dtype, *flags = run.split("-")
    if not set(flags) <= COLD_FLAGS:
        raise ValueError(f"expected a cold run DTYPE with flags among {sorted(COLD_FLAGS)}, got {run!r}")
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as bytecode:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        if "pyc" in flags:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = bytecode
        command = [sys.executable, "-c", COLD_CHILD, path, dtype, "lazy" if "lazy" in flags else "eager"]
        if "pyc" in flags or "warm" in flags:  # the untimed run that writes the bytecode or fills the Triton cache
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.cold_timeout)
            if "warm" not in flags:  # its Triton cache emptied
                shutil.rmtree(cache, ignore_errors=True)
                os.makedirs(cache, exist_ok=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.cold_timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no first token in {args.cold_timeout} s"}
        wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}
    row["process_s"] = wall
    row["bytecode_cached"] = "pyc" in flags
    row["triton_cache_warm"] = "warm" in flags
    row["warm_up_log"] = [line for line in proc.stderr.splitlines() if "warm-up:" in line or "decode " in line]
    row["log"] = [line for line in proc.stderr.splitlines() if line.split(" ", 1)[0].isdigit()][:80]
    return row


# A cold run's process: torch's import timed first (the benchmark module imports torch), then cold_child.
COLD_CHILD = (
    "import sys, time\n"
    "start = time.perf_counter()\n"
    "import torch\n"
    "torch_s = time.perf_counter() - start\n"
    "from benchmarks.engine import cold_child\n"
    "cold_child(sys.argv[1], sys.argv[2], sys.argv[3] == 'lazy', torch_s)\n"
)


def cold_child(path: str, dtype: str, lazy: bool = False, torch_s: float | None = None) -> None:
    """In a fresh process: import, construct (load + warm-up), first token, then a new prompt shape."""
    import logging

    t0 = time.perf_counter()
    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams

    # Each log line with its time in the process (ms): where construction spends its time.
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d ms %(levelname)s %(name)s: %(message)s")
    compiles = _record_compiles(t0)
    imported = time.perf_counter()
    profiler = None
    if os.environ.get("PORTATTN_COLD_PROFILE") == "1":  # where the construction's time goes, function by function
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    llm = LLM(path, device=DEVICE, dtype=dtype, max_model_len=4096, lazy_graph_capture=lazy)
    built = time.perf_counter()
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(70)
        profile_text = text.getvalue()
    graphs = llm.engine.runner.graphs
    at_start = graphs.num_captured if graphs is not None else 0
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([random_prompts(1, 128, llm.engine.vocab_size)[0]], params, use_tqdm=False)
    sync()
    first = time.perf_counter()
    llm.generate([random_prompts(1, 37, llm.engine.vocab_size)[0]] * 3, params, use_tqdm=False)
    sync()
    second = time.perf_counter()
    row = {"dtype": dtype, "lazy": lazy, "import_torch_s": torch_s, "import_s": imported - t0}
    row["construct_s"] = built - imported
    row |= {"graphs_at_start": at_start, "graphs_after": graphs.num_captured if graphs is not None else 0}
    row |= {"first_token_s": first - built, "construct_and_first_token_s": first - t0, "new_shape_s": second - first}
    if compiles is not None:  # Triton's own timing of each compile (parallel ones share the CPUs and the GIL)
        longest = max(compiles, default=(0.0, ""))
        row |= {"triton_compiles": len(compiles), "longest_compile_s": longest[0], "longest_compile": longest[1]}
        row["compiles"] = [(at, round(seconds, 2), name) for seconds, name, at in compiles]  # done at, took
    if profiler is not None:
        row["construct_profile"] = profile_text
    print(json.dumps(row), flush=True)


def _record_compiles(start: float | None = None) -> list[tuple] | None:
    """``(seconds, kernel name)`` of each Triton compile from now on (not the cache's hits), and with
    ``start`` (a ``time.perf_counter()``) the seconds from it to the compile's end third; None where
    this Triton cannot say (``compile_ahead.on_compile``)."""
    from portattn.kernels.triton.compile_ahead import on_compile

    compiles: list[tuple] = []

    def record(name: str, seconds: float, _) -> None:
        done = () if start is None else (round(time.perf_counter() - start, 2),)
        compiles.append((seconds, name, *done))

    return compiles if on_compile(record) else None


def part_cascade(args, results: dict) -> dict:
    path = checkpoint(f"llama3_8b_{args.layers}l", llama3_8b_config(args.layers), args.workdir)
    longest = max(args.cascade_shared) + args.cascade_own + 4 * args.steps + 64
    llm = make_llm(
        path,
        max_num_seqs=max(args.cascade_batches),
        max_model_len=longest,
        kv_cache_memory=args.kv_gib << 30,
        allow_long_max_model_len=True,
        enable_cascade_attn=True,
    )
    rows = [
        cascade_point(llm, batch, shared, args.cascade_own, args.steps)
        for shared in args.cascade_shared
        for batch in args.cascade_batches
    ]
    return {"model": "llama3-8b", "layers": args.layers, "rule": str(llm.engine.runner.cascade_rule), "rows": rows}


def part_family(args, results: dict, name: str) -> dict:
    from portattn.engine.sampling_params import SamplingParams

    bandwidth = copy_tb_s(args, results)
    config = llama4_config(args.family_layers) if name == "llama4" else deepseek_v3_config(args.family_layers)
    path = checkpoint(f"{name}_{args.family_layers}l", config, args.workdir)
    llm = make_llm(path, max_num_seqs=max(args.family_batches), max_model_len=args.context + 512,
                   kv_cache_memory=args.kv_gib << 30, quantization=args.quantization)  # fmt: skip
    rows = [decode_point(llm, b, args.context, args.steps, bandwidth) for b in args.family_batches]
    # Greedy tokens of graphs and eager from the same prompts.
    prompts = random_prompts(4, args.context, llm.engine.vocab_size, seed=5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with_graphs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None
    eager = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.runner.graphs = graphs
    agree = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(g)) for g, e in zip(with_graphs, eager)]
    return {"model": name, "layers": args.family_layers, "rows": rows, "tokens_agreeing": agree}


# -- report ------------------------------------------------------------------------------------


def load_results(out: Path) -> dict:
    results = {}
    for file in sorted(out.glob("engine_*.json")):
        results[file.stem.removeprefix("engine_")] = json.loads(file.read_text())
    return results


def _decode_panel(ax, part: dict) -> None:
    rows = part["rows"]
    batches = [r["batch"] for r in rows]
    ax.plot(batches, [r["limit_ms"] for r in rows], "k--", label="streaming limit (weights + KV) / copy bandwidth")
    if all("limit_spec_ms" in r for r in rows):
        ax.plot(batches, [r["limit_spec_ms"] for r in rows], "k:", label=f"streaming limit at {SPEC_TB_S} TB/s")
    series = (
        ("graphs_step_ms", "o-", "engine step, graphs (greedy)"),
        ("graphs_sampled_step_ms", "v-", "engine step, graphs (sampled)"),
        ("graphs_replay_ms", "^:", "graph replay alone"),
        ("eager_step_ms", "s-", "engine step, eager"),
    )
    for key, style, label in series:
        if all(key in r for r in rows):
            ax.plot(batches, [r[key] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{part['model']}, {part['layers']} layers, bf16, {rows[0]['context']}-token contexts", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _coldstart_panel(ax, runs: dict) -> None:
    names = [n for n, r in runs.items() if "construct_s" in r]
    bottom = [0.0] * len(names)
    for key, label in (("import_torch_s", "import torch"), ("import_s", "import of portattn's LLM (after torch)"),
                       ("construct_s", "construct (load + graphs + warm-up)"),
                       ("first_token_s", "first token")):  # fmt: skip
        values = [runs[n].get(key) or 0.0 for n in names]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(25, color="k", ls="--", lw=1, label="target (bf16)")
    ax.set_ylabel("seconds")
    ax.set_title("cold start, fresh process, empty Triton cache", fontsize=9)
    ax.legend(fontsize=7)


def _throughput_panel(ax, results: dict) -> None:
    labels, values = [], []
    for key, label in (("throughput", "portattn"), ("hf", "transformers"), ("hf-compile", "transformers + compile")):
        part = results.get(key) or {}
        if "output_tokens_per_s" in part:
            labels.append(label)
            values.append(part["output_tokens_per_s"])
    ax.bar(labels, values)
    ax.set_ylabel("output tokens / s")
    ax.set_title("offline generation, Llama-3-8B shape", fontsize=9)


def plot(out: Path, results: dict) -> Path | None:
    """``engine_gpu.png``: one panel per decode part, the cold starts and the offline throughput found
    in ``results`` (None: nothing to draw)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(_decode_panel, results[k]) for k in ("decode", "llama4", "deepseek") if results.get(k, {}).get("rows")]
    runs = coldstart_runs(results.get("coldstart"))
    if any("construct_s" in r for r in runs.values()):
        panels.append((_coldstart_panel, runs))
    if "output_tokens_per_s" in results.get("throughput", {}):
        panels.append((_throughput_panel, results))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (draw_panel, data) in zip(axes[0], panels):
        draw_panel(ax, data)
    fig.tight_layout()
    path = out / "engine_gpu.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _process_to_token(row: dict) -> float | None:
    """A cold run's fresh process to its first token: torch's import, portattn's, construction, first token."""
    if "construct_and_first_token_s" not in row:
        return None
    return row["construct_and_first_token_s"] + (row.get("import_torch_s") or 0.0)


def coldstart_runs(cold: dict | None) -> dict:
    """The cold-start rows by run name (``{"runs": ...}``; older results keyed the rows by dtype)."""
    if not cold:
        return {}
    runs = cold.get("runs", cold)
    return {name: row for name, row in runs.items() if isinstance(row, dict)}


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def notes(results: dict) -> str:
    lines = ["# Engine on the GPU", ""]
    copy = results.get("copy")
    if copy:
        lines += [f"Copy bandwidth {copy['copy_tb_s']:.2f} TB/s (read + write); bf16 matmul "
                  f"{copy['matmul_tflop_s']:.0f} TFLOP/s. Limits: weights + KV read once per step at the copy "
                  f"bandwidth, and at the specified {SPEC_TB_S} TB/s.", ""]  # fmt: skip
    for key in ("decode", "llama4", "deepseek"):
        part = results.get(key)
        if not part:
            continue
        lines += [f"## Decode: {part['model']}, {part['layers']} layers", ""]
        if part.get("kernel_options"):
            lines += [f"Launch options: {', '.join(part['kernel_options'])}.", ""]
        if part.get("quantization"):
            lines += [f"Linear layers in {part['quantization']} (`--quantization`): the limits count their bytes.", ""]
        lines += ["| batch | limit ms (copy / spec) | async step ms | x limit | graphs step ms | x limit (copy / spec) "
                  "| replay ms | host ms | sampled step ms | draw ms (top-k + top-p / top-p alone) | eager step ms "
                  "| x limit | plan us (graphs / eager) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in part["rows"]:
            lines.append(
                f"| {r['batch']} | {r['limit_ms']:.2f} / {fmt(r.get('limit_spec_ms'))} "
                f"| {fmt(r.get('async_step_ms'))} | {fmt(r.get('async_vs_limit'))} "
                f"| {fmt(r.get('graphs_step_ms'))} | {fmt(r.get('graphs_vs_limit'))} / {fmt(r.get('graphs_vs_spec'))} "
                f"| {fmt(r.get('graphs_replay_ms'))} | {fmt(r.get('graphs_host_ms'))} "
                f"| {fmt(r.get('graphs_sampled_step_ms'))} | {fmt(r.get('graphs_draw_ms'), '.3f')} "
                f"/ {fmt(r.get('graphs_nucleus_draw_ms'), '.3f')} "
                f"| {fmt(r.get('eager_step_ms'))} | {fmt(r.get('eager_vs_limit'))} "
                f"| {fmt(r.get('graphs_plan_us'), '.0f')} / {fmt(r.get('eager_plan_us'), '.0f')} |"
            )
        lines.append("\nAsync: steps under async scheduling (the engine's default on a GPU), each launched before the "
                     "previous one's tokens are read; graphs: synchronous steps replaying the decode graph. "
                     "Replay: the decode graph (the step's plan, model, LM head, argmax); plan (graphs): the host "
                     "writing the step's inputs and copying them; host: step - replay; sampled: the same "
                     "batch at temperature 0.8, top-k 50, top-p 0.95, with the draw graph (timed alone) after the "
                     "replay; top-p alone: temperature 0.6, top-p 0.9 (the nucleus draw, no sort).")  # fmt: skip
        routed = [r for r in part["rows"] if "routed_limit_ms" in r]
        if routed:
            points = "; ".join(
                f"batch {r['batch']}: {r['routed_limit_ms']:.2f} ms, async step {fmt(r.get('async_vs_routed_limit'))}x"
                for r in routed
            )
            lines.append(f"\nThe limit above counts every expert; over the experts a batch routes to (expected "
                         f"under uniform routing): {points}.")  # fmt: skip
        if "tokens_agreeing" in part:
            lines.append(f"\nGreedy tokens of graphs and eager agree for {part['tokens_agreeing']} of 16 per prompt.")
        lines.append("")
    launches = results.get("launches")
    if launches:
        lines += [f"## Launches: {launches['eager_per_layer']:.1f} kernels per layer per eager decode step "
                  f"({launches['eager_kernels']} in all; {launches['unfused_per_layer']:.1f} without the fused "
                  "kernels)"]  # fmt: skip
        if "replay_per_layer" in launches:
            lines[-1] += f"; a replay shows {launches['replay_per_layer']:.1f} per layer"
        lines += ["", "Most frequent (eager): " + ", ".join(f"{n} x{c}" for n, c in launches["eager_top"][:12]), ""]
    tp, hf, hfc = results.get("throughput"), results.get("hf"), results.get("hf-compile")
    if tp:
        lines += ["## Offline throughput", "", f"portattn, {tp.get('model', 'llama3-8b')}: {tp['requests']} "
                  f"requests of {tp['prompt_len']} + {tp['output_len']} tokens in {tp['seconds']:.1f} s: "
                  f"{tp['output_tokens_per_s']:.0f} output "
                  f"tokens/s ({tp['total_tokens_per_s']:.0f} tokens/s with the prompts); {tp['replayed_steps']} of "
                  f"{tp['steps']} steps replayed graphs; {tp['preemptions']} preemptions"
                  f"{'; async scheduling' if tp.get('async_scheduling') else ''}."]  # fmt: skip
        if "queue_seconds" in tp:
            lines.append(f"checking and queueing the requests before the first step: {tp['queue_seconds']:.3f} s.")
        for kind in ("prefill", "decode"):
            k = tp.get(f"{kind}_steps")
            if k:
                lines.append(f"{kind} steps{' (any prompt chunk)' if kind == 'prefill' else ''}: {k['steps']} in "
                             f"{k['seconds']:.1f} s, {k['ms_per_step']:.1f} ms a step, {k['tokens_per_step']:.0f} "
                             f"tokens of {k['sequences_per_step']:.0f} sequences a step.")  # fmt: skip
        for name, part in (("transformers eager", hf), ("transformers static cache + compile", hfc)):
            if not part:
                continue
            if "error" in part:
                lines.append(f"{name}: did not run ({part['error']}).")
            else:
                lines.append(f"{name}: {part['output_tokens_per_s']:.0f} output tokens/s over {part['requests']} "
                             f"requests in batches of {part['batch']}: portattn is "
                             f"{tp['output_tokens_per_s'] / part['output_tokens_per_s']:.1f}x.")  # fmt: skip
        lines.append("")
    runs = coldstart_runs(results.get("coldstart"))
    if runs:
        lines += ["## Cold start (fresh process, empty Triton cache)", "",
                  "| run | import s (torch / portattn) | construct s (load + warm-up) | graphs at start "
                  "| first token s | total s (after torch / with it) | new prompt shape s | Triton compiles "
                  "| longest compile s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][-200:]!r} | | | | | | | |")
                continue
            lines.append(f"| {name} | {fmt(r.get('import_torch_s'), '.1f')} / {fmt(r.get('import_s'), '.1f')} "
                         f"| {fmt(r.get('construct_s'), '.1f')} "
                         f"| {r.get('graphs_at_start', '-')} | {fmt(r.get('first_token_s'), '.1f')} "
                         f"| {fmt(r.get('construct_and_first_token_s'), '.1f')} / {fmt(_process_to_token(r), '.1f')} "
                         f"| {fmt(r.get('new_shape_s'), '.1f')} | {r.get('triton_compiles', '-')} "
                         f"| {fmt(r.get('longest_compile_s'), '.1f')} {r.get('longest_compile', '')} |")  # fmt: skip
        lines.append("")
    cascade = results.get("cascade")
    if cascade:
        lines += [f"## Shared prefixes: cascade or graphs ({cascade['model']}, {cascade['layers']} layers)", "",
                  "| batch | shared | own | graphs ms | cascade graphs ms | x graphs | eager ms | eager cascade ms "
                  "| rule ms (cascaded) | rule vs best | rule's saved GB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in cascade["rows"]:
            lines.append(f"| {r['batch']} | {r['shared']} | {r['own']} | {r['graphs_step_ms']:.2f} "
                         f"| {fmt(r.get('cascade_graphs_step_ms'))} | {fmt(r.get('cascade_graphs_vs_graphs'))}x "
                         f"| {r['eager_step_ms']:.2f} | {r['cascade_step_ms']:.2f} "
                         f"| {r['auto_step_ms']:.2f} ({r['auto_cascades']:.0%}) | {r['auto_vs_best']:.2f} "
                         f"| {r['rule_saved_bytes'] / 1e9:.1f} |")  # fmt: skip
        lines += ["", f"Rule: {cascade['rule']}. Graphs and eager attend plainly; cascade graphs: every step in "
                  "the graphs' cascade shape; eager cascade: every step eagerly through the cascade; rule: the "
                  "rule's defaults.", ""]  # fmt: skip
    lines += targets(results)
    return "\n".join(lines) + "\n"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def targets(results: dict) -> list[str]:
    """Issue 23's targets, from what ``results`` holds."""
    out = ["## Targets (H200)", ""]
    decode = {r["batch"]: r for r in results.get("decode", {}).get("rows", [])}
    for batch, bound in ((1, 1.2), (64, 1.3)):
        r = decode.get(batch)
        if r and "graphs_vs_limit" in r:
            spec = f", {r['graphs_vs_spec']:.2f}x at {SPEC_TB_S} TB/s" if "graphs_vs_spec" in r else ""
            x = r.get("async_vs_limit", r["graphs_vs_limit"])
            ahead = f"with async scheduling {x:.2f}x, " if "async_vs_limit" in r else ""
            out.append(f"- batch-{batch} decode step {ahead}synchronously {r['graphs_vs_limit']:.2f}x the streaming "
                       f"limit at the copy bandwidth{spec} (target <= {bound}x): {_met(x <= bound)}")  # fmt: skip
    tp = results.get("throughput")
    if tp and "total_tokens_per_s" in tp and tp.get("model", "llama3-8b") == "llama3-8b":
        total = tp["total_tokens_per_s"]
        out.append(f"- offline throughput {total:,.0f} total tokens/s (target >= 30,000): {_met(total >= 30000)}")
    cold = coldstart_runs(results.get("coldstart"))
    for name, r in cold.items():
        if name.startswith("bfloat16") and "construct_and_first_token_s" in r:
            s = _process_to_token(r)
            if r.get("triton_cache_warm"):  # a restart: no target of its own
                out.append(f"- {name} start on a warm Triton cache to the first token {s:.1f} s with torch's import")
                continue
            out.append(f"- {name} cold start to the first token {s:.1f} s with torch's import (target <= 25 s): "
                       f"{_met(s <= 25)}")  # fmt: skip
        if name.startswith("float32") and "longest_compile_s" in r:
            s = r["longest_compile_s"]
            out.append(f"- {name}: longest Triton compile {s:.1f} s, {r['longest_compile']} (target <= 30 s): "
                       f"{_met(s <= 30)}")  # fmt: skip
    for name, r in cold.items():
        if "import_s" in r:
            torch_s = f" on top of torch's {r['import_torch_s']:.1f} s" if "import_torch_s" in r else ""
            out.append(f"- {name}: import of portattn's LLM {r['import_s']:.1f} s{torch_s} (target <= 2 s): "
                       f"{_met(r['import_s'] <= 2)}")  # fmt: skip
            break
    return out


PART_RUNNERS = {
    "copy": part_copy,
    "decode": part_decode,
    "launches": part_launches,
    "throughput": part_throughput,
    "hf": lambda a, r: part_hf(a, r, compiled=False),
    "hf-compile": lambda a, r: part_hf(a, r, compiled=True),
    "coldstart": part_coldstart,
    "cascade": part_cascade,
    "llama4": lambda a, r: part_family(a, r, "llama4"),
    "deepseek": lambda a, r: part_family(a, r, "deepseek"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["copy", "decode", "launches"], choices=PARTS)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints are written (reused)")
    parser.add_argument("--model", default=None, help="the throughput part's checkpoint or GGUF file (default: "
                        "the Llama-3-8B shape, random weights)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    parser.add_argument("--kv-gib", type=int, default=48, help="KV-cache memory of the engines")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--chunked-prefill", type=int, default=16384)
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="the throughput part's engine launches decode steps ahead (default: the engine's, on where it can run)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-steps", action="store_true",
        help="the throughput part then profiles one prompt-chunk step and one full decode step (synchronous)",
    )  # fmt: skip
    parser.add_argument("--hf-requests", type=int, default=128, help="requests timed through transformers")
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--cold-runs", nargs="+", default=["bfloat16", "bfloat16-lazy", "float32"],
                        help="cold starts: a dtype, with -lazy for lazy_graph_capture, -pyc for Python's bytecode "
                             "cached (as an install leaves it)")  # fmt: skip
    parser.add_argument("--cold-timeout", type=int, default=400)
    parser.add_argument("--cascade-batches", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--cascade-shared", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--cascade-own", type=int, default=256)
    parser.add_argument("--family-layers", type=int, default=4)
    parser.add_argument("--launches-model", default="llama3_8b", choices=["llama3_8b", "llama4", "deepseek"],
                        help="the launches part's model (llama4 / deepseek: the family part's shapes)")  # fmt: skip
    parser.add_argument("--family-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--quantization", default=None, choices=QUANTIZATIONS,
        help="the engines' quantization= (decode, launches, throughput and family parts; the limits count the "
        "weights' bytes as stored)",
    )  # fmt: skip
    parser.add_argument(
        "--kernel-options", nargs="*", default=[], choices=sorted(KERNEL_OPTIONS),
        help="launch options away from their defaults for this run (recorded in the results)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the engine benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    apply_kernel_options(args.kernel_options)
    args.workdir = args.workdir or default_workdir()
    args.out.mkdir(parents=True, exist_ok=True)
    results = load_results(args.out)
    for part in PARTS:
        if part not in args.parts:
            continue
        start = time.perf_counter()
        results[part] = PART_RUNNERS[part](args, results)
        results[part]["part_seconds"] = time.perf_counter() - start
        results[part]["kernel_options"] = args.kernel_options
        results[part]["quantization"] = args.quantization
        (args.out / f"engine_{part}.json").write_text(json.dumps(results[part], indent=1))
        if part != "copy" and "copy" in results:  # measured on the way, for the limit
            (args.out / "engine_copy.json").write_text(json.dumps(results["copy"], indent=1))
    plot(args.out, results)
    (args.out / "engine_gpu.md").write_text(notes(results))
    print(notes(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
