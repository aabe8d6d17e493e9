"""``python -m benchmarks.random_checkpoint DIR [--shape llama3-8b] [--device cuda]``: a Llama
checkpoint of a real model's shape with random weights (normal, std 0.02; norms at 1), in shards of
safetensors with an index, plus a word-level tokenizer of the full vocabulary (``t0 t1 ...``), so that
a server benchmark pays for detokenization too. Weights are drawn on ``--device`` (fast on a GPU)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch


def _llama3_shape(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, positions: int):
    """The config sizes of a Llama 3 layout (rope theta 500000, RMS norm eps 1e-5, untied head)."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


SHAPES = {
    "llama3-8b": _llama3_shape(128256, 4096, 14336, 32, 32, 8, 8192),  # Meta-Llama-3-8B's config
    "tiny": _llama3_shape(512, 64, 128, 2, 4, 2, 1024),  # the same layout at toy size (tests)
}


def _tensors(cfg: dict, layer: int | None) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes: one decoder layer's, or (``None``) the embeddings, norm and head."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    if layer is None:
        return {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    p = f"model.layers.{layer}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }


def write_random_llama(
    path: str | Path, shape: str = "llama3-8b", *, dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0
) -> str:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    cfg = SHAPES[shape]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bos, eos = 0, 1
    LlamaConfig(**cfg, bos_token_id=bos, eos_token_id=eos, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(path)
    words = ["<s>", "</s>", *(f"t{k}" for k in range(2, cfg["vocab_size"]))]
    tok = Tokenizer(models.WordLevel({w: k for k, w in enumerate(words)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="t2").save_pretrained(
        path
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map = {}
    groups = [None, *range(cfg["num_hidden_layers"])]
    for n, layer in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for key, size in _tensors(cfg, layer).items():
            if len(size) == 1:
                shard[key] = torch.ones(size, dtype=dtype)
            else:
                shard[key] = (torch.randn(size, generator=gen, device=device) * 0.02).to(dtype).cpu()
            weight_map[key] = name
        save_file(shard, path / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return str(path)


# -- any transformers config (the engine benchmark's Llama 4 and DeepSeek-V3 shapes) ----------------
# The model of the config is built on the ``meta`` device (names and shapes, no memory); each tensor is
# drawn on ``device`` (normal, std 0.02; norms 1, biases 0) and saved in shards of about 2 GB beside
# ``config.json``. A directory that already holds a checkpoint of the same config is reused.

SHARD_BYTES = 2 << 30


def _value(name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, generator) -> torch.Tensor:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, dtype=dtype, device=device, generator=generator).mul_(0.02)


_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_shapes(model, config):
    """``(name, shape)`` of each tensor as ``save_pretrained`` writes it: transformers' DeepSeek V3 keeps
    its experts stacked in memory but saves one ``gate_proj`` / ``up_proj`` / ``down_proj`` per expert."""
    for name, meta in model.state_dict().items():
        match = _FUSED_EXPERTS.match(name) if config.model_type == "deepseek_v3" else None
        if match is None:
            yield name, meta.shape
            continue
        prefix, kind = match.groups()
        experts, inter, hidden = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        for e in range(experts):
            if kind == "gate_up_proj":
                yield f"{prefix}.{e}.gate_proj.weight", torch.Size((inter, hidden))
                yield f"{prefix}.{e}.up_proj.weight", torch.Size((inter, hidden))
            else:
                yield f"{prefix}.{e}.down_proj.weight", torch.Size((hidden, inter))


def write_random_checkpoint(
    config, path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0
) -> Path:
    """A checkpoint directory of ``config`` (a transformers config) with random ``dtype`` weights (no tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    stamp = json.dumps(config.to_dict(), sort_keys=True, default=str) + str(dtype) + str(seed)
    if (path / "stamp.txt").is_file() and (path / "stamp.txt").read_text() == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    generator = torch.Generator(device=device).manual_seed(seed)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    weight_map, shard, shard_bytes, index = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_bytes, index = {}, 0, index + 1

    for name, shape in checkpoint_shapes(model, config):
        if name in tied:
            continue
        shard[name] = _value(name, shape, dtype, torch.device(device), generator).cpu()
        shard_bytes += shard[name].numel() * shard[name].element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    index_file = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_file))
    (path / "stamp.txt").write_text(stamp)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.random_checkpoint", description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn")
    args = parser.parse_args(argv)
    print(write_random_llama(args.path, args.shape, dtype=getattr(torch, args.dtype), device=args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
