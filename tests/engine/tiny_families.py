"""Tiny random checkpoints of gpt-oss, Gemma 2, Gemma 3 and Mistral, and an MXFP4 version of gpt-oss's.

Each config is small (hidden 64, vocab 256) with windows of 8 to 12 tokens, so that every prompt
and decode of the parity tests crosses them; head dims are ones the Triton backend runs (64, 128,
256), so that the same tests exercise it on a GPU. Where transformers' initialisation would leave a
feature inert, those tensors are drawn at random too: gpt-oss's attention and expert biases and its
sinks; Gemma's ``(1 + w)`` norm weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("gpt_oss", "gemma2", "gemma3", "mistral")
ARCHITECTURES = {
    "gpt_oss": "GptOssForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SEEDS = dict.fromkeys(FAMILIES, 1234)
COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def tiny_config(family: str, **overrides):
    """transformers' config of ``family``'s tiny checkpoint; ``overrides`` replace its keyword arguments."""
    import transformers

    if family == "gpt_oss":
        # Sliding (8 tokens) and full layers, head dim 64, YaRN, 4 experts of which 2 are picked, and
        # a SwiGLU limit low enough that the clamps act.
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0}
        yarn |= {"truncate": False, "original_max_position_embeddings": 64}
        kwargs = COMMON | dict(head_dim=64, intermediate_size=32, num_hidden_layers=2, sliding_window=8)
        kwargs |= dict(num_local_experts=4, num_experts_per_tok=2, swiglu_limit=2.0, max_position_embeddings=256)
        return transformers.GptOssConfig(**(kwargs | dict(rope_parameters=yarn) | overrides))
    if family == "gemma2":
        # Sliding (12 tokens) and full layers, head dim 256, softmax scale 144 ** -0.5, attention and
        # final softcaps low enough to bend the tiny model's scores and logits.
        kwargs = COMMON | dict(head_dim=256, intermediate_size=128, num_hidden_layers=2, sliding_window=12)
        kwargs |= dict(query_pre_attn_scalar=144, attn_logit_softcapping=20.0, final_logit_softcapping=8.0)
        return transformers.Gemma2Config(**(kwargs | dict(max_position_embeddings=256) | overrides))
    if family == "gemma3":
        # Five sliding (10 tokens) layers, then a full one; local base 10k, global base 1M with linear
        # scaling; q/k norms; head dim 128, softmax scale 96 ** -0.5.
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        }
        kwargs = COMMON | dict(head_dim=128, intermediate_size=128, num_hidden_layers=6, sliding_window=10)
        kwargs |= dict(query_pre_attn_scalar=96, max_position_embeddings=256)
        return transformers.Gemma3TextConfig(**(kwargs | dict(rope_parameters=rope) | overrides))
    if family == "mistral":  # a window of 11 tokens on every layer, head dim 128
        kwargs = COMMON | dict(head_dim=128, intermediate_size=128, num_hidden_layers=2, sliding_window=11)
        return transformers.MistralConfig(**(kwargs | dict(max_position_embeddings=256) | overrides))
    raise ValueError(f"expected a family in {FAMILIES}, got {family!r}")


def tiny_model(family: str, *, seed: int | None = None, **overrides) -> torch.nn.Module:
    """transformers' float32 model of ``tiny_config(family, **overrides)`` with random weights from
    ``torch.manual_seed(seed)`` (default ``SEEDS[family]``); this reseeds torch's global generator."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(SEEDS[family] if seed is None else seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if family == "gpt_oss" and name.endswith(("_proj.bias", "proj_bias")):
                param.normal_(0.0, 0.2)  # attention and expert biases (zero at init)
            elif family == "gpt_oss" and name.endswith("self_attn.sinks"):
                param.normal_(0.0, 1.0)
            elif family.startswith("gemma") and name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)  # (1 + w) norms (w = 0 at init)
    return model


def save_tiny_checkpoint(family: str, path: str | Path, *, seed: int | None = None, **overrides) -> str:
    """Save :func:`tiny_model` with ``save_pretrained`` under ``path``; returns ``str(path)``."""
    tiny_model(family, seed=seed, **overrides).save_pretrained(path)
    return str(path)


# -- MXFP4 ---------------------------------------------------------------------------------------

_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., cols]`` (cols a multiple of 32) -> ``(blocks [..., cols/32, 16], scales [..., cols/32])``
    uint8: per group of 32, the smallest power of two that brings the group within FP4's ±6, and
    each value rounded to the nearest FP4 number (low nibble first)."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)  # [..., G, 32]
    amax = groups.abs().amax(dim=-1)  # [..., G]
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - _FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks, (exponent + 127).to(torch.uint8)


def save_tiny_mxfp4_checkpoint(path: str | Path, *, seed: int | None = None, **overrides) -> str:
    """The tiny gpt-oss checkpoint with its experts stored as gpt-oss's released checkpoints store them:
    ``mlp.experts.{gate_up,down}_proj_{blocks,scales}`` (MXFP4 of the ``[E, out, in]`` matrices) and
    ``quantization_config = {"quant_method": "mxfp4", ...}``."""
    from safetensors.torch import load_file, save_file

    path = Path(save_tiny_checkpoint("gpt_oss", path, seed=seed, **overrides))
    file = path / "model.safetensors"
    state = load_file(file)
    for key in [k for k in state if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state.pop(key).transpose(1, 2))  # [E, in, out] -> [E, out, in]
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(state, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)
