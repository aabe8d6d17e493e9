"""Vision-encoder benchmark: ``python -m benchmarks.vision [--device cpu|cuda|xpu] [--out FILE]``.

CPU (default): encoder tokens/s of portattn's Qwen2.5-VL vision tower, with each ``mm`` backend
that runs natively here, against ``transformers``' tower (SDPA) with the same random weights on
the same images, and the largest relative difference of the merged embeddings.

GPU: a tower of Qwen2.5-VL's real size (hidden 1280, 16 heads of dim 80, 32 blocks, full attention
in every 8th, window 112, patch 14, merge 2; random weights, bf16) over images of 1-4k patches.
Per backend: the tower's median time and tokens/s, the time of its 32 attention calls alone
(replayed with the same shapes and per-forward metadata), their share of the tower, and their
TFLOP/s (``4 * H * D * sum(L_i**2)`` per call, non-causal); ``transformers``' tower when it is
installed. The reference backend (``torch``) is timed on the GPU only for the 1024-patch image.
Times come from :func:`portattn.bench.timing.measure`; the implementations of one case
are measured in interleaved rounds (median of the rounds' medians).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys

import torch

from portattn.backends.registry import available_backends, backend_class
from portattn.backends.torch_ref import TorchBackend
from portattn.bench.timing import measure, num_input_sets
from portattn.models.loader import default_dtype, load_state
from portattn.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, tower_checkpoint_name
from portattn.testing import vision_tower_config

# The config entries recorded with the results (the towers: portattn.testing.vision_tower_config).
CONFIG_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "fullatt_block_indexes")
CONFIG_KEYS += ("patch_size", "spatial_merge_size", "temporal_patch_size", "window_size", "hidden_act")

CPU_CASES = {  # name -> image grids (t, h, w) in patches
    "1 image 16x16": [(1, 16, 16)],
    "3 images 16x16, 24x32, 12x20": [(1, 16, 16), (1, 24, 32), (1, 12, 20)],
}
GPU_CASES = {
    "1 image 32x32 (1024)": [(1, 32, 32)],
    "1 image 64x64 (4096)": [(1, 64, 64)],
    "4 images 1024-4096": [(1, 32, 32), (1, 36, 50), (1, 48, 64), (1, 64, 64)],
}


REFERENCE = TorchBackend.name  # the float64-checked reference backend: on a GPU, timed on the smallest case only
REFERENCE_MAX_TOKENS_ON_GPU = 1024
SLOW_MS = 250.0  # a tower slower than this per call (the reference backend on a GPU) is timed once


def time_interleaved(fns: dict, device: torch.device, *, rounds: int = 5, runs: int = 3) -> dict[str, float]:
    """Median milliseconds of each function: ``rounds`` rounds of :func:`~portattn.bench.timing.measure`,
    every function measured in each round, so that load from other processes falls on all alike.
    A function slower than ``SLOW_MS`` on its first (warm) call keeps the time of one more call."""
    slow = {}
    for name, fn in fns.items():
        ms = measure(lambda _, f=fn: f(), [None], device, warmup=1, runs=1, burst=0).median_ms
        if ms > SLOW_MS:
            slow[name] = ms
    medians: dict[str, list[float]] = {name: [] for name in fns if name not in slow}
    for _ in range(rounds):
        for name in medians:
            timing = measure(lambda _, f=fns[name]: f(), [None], device, warmup=1, runs=runs, burst=1)
            medians[name].append(timing.median_ms)
    return {name: statistics.median(m) for name, m in medians.items()} | slow


def _random_weights(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under transformers' tower names (the checkpoint's, less the ``visual.`` prefix)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    with torch.device("meta"):
        names = dict(Qwen2_5_VisionTransformerPretrainedModel(config).named_parameters())
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in names.items():
        if "norm" in name or "ln_q" in name:
            state[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("bias"):
            state[name] = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            state[name] = torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5
    return state


def _build(config, state, *, dtype, device, backend) -> Qwen2_5_VisionTransformer:
    with torch.device(device), default_dtype(dtype):
        tower = Qwen2_5_VisionTransformer(config, dtype=dtype, device=device, mm_attention_backend=backend)
    load_state(tower, state, lambda key: tower_checkpoint_name("visual." + key), what="the vision tower")
    return tower.eval().requires_grad_(False)


def _hf_tower(config, state, *, dtype, device):
    """transformers' tower with the same weights, or ``None`` when transformers lacks it."""
    try:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    except ImportError:
        return None
    config._attn_implementation = "sdpa"
    with torch.device(device):
        hf = Qwen2_5_VisionTransformerPretrainedModel(config)
    hf.load_state_dict(state, strict=True)
    # transformers keeps inv_freq in float32 when loading in bf16, and some versions build it on the CPU.
    inv_freq = hf.rotary_pos_emb.inv_freq.to(device=device, dtype=torch.float32)
    hf.to(device=device, dtype=dtype).eval().requires_grad_(False)
    hf.rotary_pos_emb.inv_freq = inv_freq
    return hf


def _inputs(grids, config, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grid_thw = torch.tensor(grids)
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=gen).to(device=device, dtype=dtype)
    return pixel_values, grid_thw


def _attention_only(tower, info, pixel_values) -> tuple[float, float]:
    """(ms, flops) of the tower's attention calls alone, with the forward's shapes and metadata."""
    device = pixel_values.device
    n, heads, dim = info.num_tokens, tower.config.num_heads, tower.head_dim
    sets = num_input_sets(3 * n * heads * dim * pixel_values.element_size())  # rotated past the L2 cache
    qkv = [
        tuple(torch.randn(n, heads, dim, device=device).to(pixel_values.dtype) for _ in range(3)) for _ in range(sets)
    ]
    full = sum(block.full_attention for block in tower.blocks)
    total_ms = flops = 0.0
    for count, metadata in ((full, info.full), (len(tower.blocks) - full, info.window)):
        if count:
            timing = measure(lambda x, m=metadata: tower.attention(*x, m), qkv, device)
            total_ms += count * timing.median_ms
            flops += count * 4 * heads * dim * sum(length**2 for length in metadata.q_lens)
    return total_ms, flops


def run(device: torch.device, size: str | None = None) -> dict:
    """``size``: ``"small"`` (float32, the CPU cases) or ``"real"`` (bf16, the GPU cases); default by device."""
    size = size or ("small" if device.type == "cpu" else "real")
    if size not in ("small", "real"):
        raise ValueError(f"expected size 'small' or 'real', got {size!r}")
    config = vision_tower_config(size)
    dtype = torch.float32 if size == "small" else torch.bfloat16
    cases = CPU_CASES if size == "small" else GPU_CASES
    state = _random_weights(config)
    backends = [
        b
        for b in available_backends(device)
        if backend_class(b).runs_natively(device) and backend_class(b).capabilities.supports("op", "varlen_attention")
    ]
    towers = {b: _build(config, state, dtype=dtype, device=device, backend=b) for b in backends}
    hf = _hf_tower(config, state, dtype=dtype, device=device)
    peer_error = None
    rows = []
    with torch.inference_mode():
        for case, grids in cases.items():
            pixel_values, grid_thw = _inputs(grids, config, dtype, device)
            tokens = pixel_values.shape[0]
            timed = {
                b: t
                for b, t in towers.items()
                if b != REFERENCE or device.type == "cpu" or tokens <= REFERENCE_MAX_TOKENS_ON_GPU
            }
            fns = {b: functools.partial(t, pixel_values, grid_thw) for b, t in timed.items()}
            ref = None
            if hf is not None:
                try:  # the peer is optional: a transformers version that fails here is recorded, not fatal
                    ref = hf(pixel_values, grid_thw.to(device)).pooler_output.float()
                    fns["transformers"] = functools.partial(hf, pixel_values, grid_thw.to(device))
                except RuntimeError as exc:
                    peer_error = f"{type(exc).__name__}: {str(exc)[:160]}"
                    print(f"transformers' tower skipped: {peer_error}", file=sys.stderr)
                    hf = None
            ms_of = time_interleaved(fns, device)
            for backend, tower in timed.items():
                ms = ms_of[backend]
                row = {
                    "case": case,
                    "tokens": tokens,
                    "backend": backend,
                    "ms": round(ms, 3),
                    "tokens_per_s": round(tokens / ms * 1e3),
                }
                if ref is not None:
                    hf_ms = ms_of["transformers"]
                    out = tower(pixel_values, grid_thw).float()
                    row["transformers_ms"] = round(hf_ms, 3)
                    row["transformers_tokens_per_s"] = round(tokens / hf_ms * 1e3)
                    row["speedup_vs_transformers"] = round(hf_ms / ms, 3)
                    row["max_rel_diff"] = float((out - ref).abs().max() / ref.abs().max())
                attn_ms, flops = _attention_only(tower, tower.plan(grid_thw), pixel_values)
                row["attention_ms"] = round(attn_ms, 3)
                row["attention_share"] = round(attn_ms / ms, 3)
                row["attention_tflops"] = round(flops / attn_ms / 1e9, 3)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return {
        "device": _device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
        "load_average": os.getloadavg()[0] if device.type == "cpu" else None,
        "torch": torch.__version__,
        "config": {key: getattr(config, key) for key in CONFIG_KEYS},
        "transformers_error": peer_error,
        "rows": rows,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"cpu ({threads} thread{'s' if threads != 1 else ''})"
    return str(torch.accelerator.current_accelerator()) + f" ({device})"


def markdown(result: dict) -> str:
    rows = result["rows"]
    hf = "transformers_ms" in rows[0] if rows else False
    head = ["case", "tokens", "backend", "ms", "tokens/s"]
    if hf:
        head += ["transformers ms", "transformers tokens/s", "speed-up", "max rel diff"]
    head += ["attention ms", "attention share", "attention TFLOP/s"]
    load = f", load average {result['load_average']:.1f}" if result.get("load_average") is not None else ""
    c = result["config"]
    shape = (
        f"depth {c['depth']}, hidden {c['hidden_size']}, {c['num_heads']} heads of dim "
        f"{c['hidden_size'] // c['num_heads']}, full attention in blocks {c['fullatt_block_indexes']}, "
        f"window {c['window_size']} px, patch {c['patch_size']}, merge {c['spatial_merge_size']}"
    )
    lines = [
        f"Qwen2.5-VL vision tower ({shape}), random weights, {result['dtype']}, {result['device']}{load}, "
        f"torch {result['torch']}. Median of interleaved runs; attention = the tower's attention calls alone.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["case"], r["tokens"], r["backend"], f"{r['ms']:.1f}", r["tokens_per_s"]]
        if hf:
            cells += [
                f"{r['transformers_ms']:.1f}",
                r["transformers_tokens_per_s"],
                f"{r['speedup_vs_transformers']:.2f}x",
                f"{r['max_rel_diff']:.1e}",
            ]
        cells += [f"{r['attention_ms']:.2f}", f"{r['attention_share']:.0%}", r["attention_tflops"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vision", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (tiny tower vs transformers) or a GPU (real-size tower)")
    parser.add_argument("--size", choices=("small", "real"), default=None, help="default: small on cpu, else real")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--out", default=None, help="write the results as JSON here (and a .md table beside it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run(torch.device(args.device), args.size)
    table = markdown(result)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out.removesuffix(".json") + ".md", "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
