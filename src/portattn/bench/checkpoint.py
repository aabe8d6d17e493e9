"""Full-size checkpoints with random weights, written for benchmarks on machines without a network.

:func:`write_random_checkpoint` builds the Hugging Face model of a config on the ``meta`` device
(names and shapes, no memory), draws each tensor on ``device`` (normal, std 0.02; norms 1, biases
0), and saves them as safetensors shards of about 2 GB with an index, beside ``config.json``. A
directory that already holds a checkpoint of the same config is reused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

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
    """A checkpoint directory of ``config`` (a transformers config) with random ``dtype`` weights."""
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
