"""Tiny random Hugging Face checkpoints of every supported family, and transformers' own outputs on them.

The test suite, ``portattn demo`` and the CPU benchmarks all build their checkpoints here, so that
a family's test checkpoint is one thing. Each config is built with transformers' config class and
is small (hidden 64, vocab 256) but exercises what is distinctive about its family. Weights come
from transformers' own initialisation under a fixed seed (``SEEDS``); where that initialisation would
leave a family's feature inert, those tensors are drawn at random too (Qwen2's q/k/v biases, DeepSeek
V3's norms and expert-score biases, gpt-oss's attention and expert biases and sinks, Gemma's
``(1 + w)`` norm weights), so that a model that ignored them would not match. Sliding windows are 8
to 24 tokens, so that the test prompts and decodes cross them. :func:`save_tiny_mxfp4_checkpoint`
stores gpt-oss's experts as its released checkpoints do (MXFP4).

transformers is imported inside the functions: importing ``portattn.testing`` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

TEXT_FAMILIES = (
    "llama",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "llama4",
    "deepseek_v3",
    "mistral",
    "mixtral",
    "phi3",
    "gemma2",
    "gemma3",
    "gpt_oss",
)
VISION_FAMILIES = ("qwen2_5_vl",)  # prompts carry images; transformers' image-text-to-text model
FAMILIES = TEXT_FAMILIES + VISION_FAMILIES
SEEDS = dict.fromkeys(TEXT_FAMILIES, 1234) | {"deepseek_v3": 7, "qwen2_5_vl": 0}
ARCHITECTURES = {  # the class transformers saves each family's checkpoint as
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}

# gpt-oss: the experts' input weights are scaled by this, so that the SwiGLU clamps at 7 act.
GPT_OSS_GATE_UP_GAIN = 4.0
COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)

# DeepSeek V3's two variants: tiny_config("deepseek_v3") is "yarn"; each variant sets the same keys,
# so tiny_config("deepseek_v3", **DEEPSEEK_V3_VARIANTS[name]) gives either.
DEEPSEEK_V3_VARIANTS = {
    # q LoRA, interleaved rope with YaRN (attention factor and softmax mscale both != 1), 4 groups
    # of 2 experts of which 2 groups are kept, renormalised top-2 weights.
    "yarn": dict(
        q_lora_rank=32,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,  # max_position_embeddings / factor
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        },
    ),
    # One q_proj, rotate-half rope without scaling, 2 groups of 4 (one kept), raw sigmoid weights.
    "plain": dict(
        q_lora_rank=None,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}

# Qwen2.5-VL: special tokens at the top of the 256-token vocabulary, images of 4x4-pixel patches
# over 2 frames merged 2x2; an image of grid (t, h, w) patches has t*h*w/4 pad tokens.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 248, 249, 250, 251
PATCH_DIM = 3 * 2 * 4 * 4  # channels * temporal_patch_size * patch_size**2
IMAGE_GRID = (1, 8, 8)  # image_prompts' grid: 4 windows of 2x2 merge units, 16 pad tokens


def engine_families() -> tuple[str, ...]:
    """The families whose architecture the engine runs (registered in :mod:`portattn.models`)."""
    from ..models import supported_architectures

    supported = set(supported_architectures())
    return tuple(family for family in FAMILIES if ARCHITECTURES[family] in supported)


def tiny_config(family: str, **overrides):
    """transformers' config of ``family``'s tiny checkpoint; ``overrides`` replace its keyword arguments
    (for ``"qwen2_5_vl"``: the top-level ones, ``text_config`` and ``vision_config`` whole)."""
    import transformers

    if family == "llama":  # llama3 rope scaling and tied embeddings
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        kwargs = COMMON | dict(intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True)
        return transformers.LlamaConfig(**(kwargs | dict(rope_parameters=rope) | overrides))
    if family in ("qwen2", "qwen3"):  # the second layer has a sliding window of 24 tokens
        kwargs = COMMON | dict(intermediate_size=128, num_hidden_layers=2)
        kwargs |= dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)
        if family == "qwen2":  # q/k/v biases (drawn at random by tiny_model)
            return transformers.Qwen2Config(**(kwargs | overrides))
        return transformers.Qwen3Config(**(kwargs | dict(head_dim=16) | overrides))  # and q/k norms
    if family == "qwen2_moe":
        # Experts (8, top-2, not renormalised) and a gated shared expert on layers 0 and 2, a dense MLP
        # on layer 1; q/k/v biases (drawn at random by tiny_model); a window of 24 tokens from layer 1 on.
        kwargs = COMMON | dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3)
        kwargs |= dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])
        kwargs |= dict(shared_expert_intermediate_size=48, use_sliding_window=True, sliding_window=24)
        kwargs |= dict(max_window_layers=1)
        return transformers.Qwen2MoeConfig(**(kwargs | overrides))
    if family == "qwen3_moe":
        # Experts on layers 0 and 2 (8 experts, top-2, renormalised), a dense MLP on layer 1
        # (mlp_only_layers), q/k norms, a sliding window of 24 tokens (on every layer, as Qwen3-MoE has it).
        kwargs = COMMON | dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3)
        kwargs |= dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
        kwargs |= dict(use_sliding_window=True, sliding_window=24)
        return transformers.Qwen3MoeConfig(**(kwargs | overrides))
    if family == "llama4":
        # Chunked RoPE layers (0, 2) with chunk 32, NoPE layers (1, 3) with temperature tuning, MoE on
        # layers 1 and 3 (4 experts, top-1, shared expert), dense MLPs on 0 and 2.
        kwargs = COMMON | dict(intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4, head_dim=16)
        kwargs |= dict(num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2)
        kwargs |= dict(no_rope_layer_interval=2, attention_chunk_size=32, floor_scale=8, attn_scale=0.5)
        return transformers.Llama4TextConfig(**(kwargs | overrides))
    if family == "deepseek_v3":  # MLA; a dense layer, then grouped top-k MoE with a shared expert
        kwargs = COMMON | dict(num_key_value_heads=4, intermediate_size=96, num_hidden_layers=3)
        kwargs |= dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        kwargs |= dict(moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1)
        kwargs |= dict(num_experts_per_tok=2, max_position_embeddings=256)
        return transformers.DeepseekV3Config(**(kwargs | DEEPSEEK_V3_VARIANTS["yarn"] | overrides))
    if family == "qwen2_5_vl":  # mrope language model; vision tower with window and full-attention blocks
        mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        text = COMMON | dict(intermediate_size=128, num_hidden_layers=2, bos_token_id=0, eos_token_id=1)
        vision = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, initializer_range=0.2)
        vision |= dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64)
        vision |= dict(window_size=16, fullatt_block_indexes=[1])  # 2 x 2 merge units per window
        kwargs = dict(text_config=text | dict(rope_parameters=mrope), vision_config=vision, image_token_id=IMAGE_PAD)
        kwargs |= dict(video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
        return transformers.Qwen2_5_VLConfig(**(kwargs | overrides))
    if family == "mistral":  # a window of 11 tokens on every layer, head dim 128
        kwargs = COMMON | dict(head_dim=128, intermediate_size=128, num_hidden_layers=2, sliding_window=11)
        return transformers.MistralConfig(**(kwargs | dict(max_position_embeddings=512) | overrides))
    if family == "mixtral":  # 8 experts, top-2, on every layer; a window of 13 tokens on every layer
        kwargs = COMMON | dict(head_dim=16, intermediate_size=32, num_hidden_layers=2, sliding_window=13)
        kwargs |= dict(num_local_experts=8, num_experts_per_tok=2)
        return transformers.MixtralConfig(**(kwargs | dict(max_position_embeddings=1024) | overrides))
    if family == "phi3":  # fused qkv and gate/up tensors; a window of 13 tokens on every layer
        kwargs = COMMON | dict(intermediate_size=96, num_hidden_layers=2, sliding_window=13)
        kwargs |= dict(max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return transformers.Phi3Config(**(kwargs | overrides))
    if family == "gemma2":
        # Sliding (12 tokens) and full layers, head dim 256, softmax scale 144 ** -0.5, attention and
        # final softcaps low enough to bend the tiny model's scores and logits.
        kwargs = COMMON | dict(head_dim=256, intermediate_size=128, num_hidden_layers=2, sliding_window=12)
        kwargs |= dict(query_pre_attn_scalar=144, attn_logit_softcapping=20.0, final_logit_softcapping=8.0)
        return transformers.Gemma2Config(**(kwargs | dict(max_position_embeddings=512) | overrides))
    if family == "gemma3":
        # Five sliding (10 tokens) layers, then a full one; local base 10k, global base 1M with linear
        # scaling; q/k norms; head dim 128, softmax scale 96 ** -0.5.
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        }
        kwargs = COMMON | dict(head_dim=128, intermediate_size=128, num_hidden_layers=6, sliding_window=10)
        kwargs |= dict(query_pre_attn_scalar=96, max_position_embeddings=512)
        return transformers.Gemma3TextConfig(**(kwargs | dict(rope_parameters=rope) | overrides))
    if family == "gpt_oss":
        # Sliding (8 tokens) and full layers, head dim 64, YaRN, 4 experts of which 2 are picked. The
        # SwiGLU limit is the released models' 7 (transformers before 5.2x ignores the config's and uses
        # 7); tiny_model scales the experts' input weights so that the clamps act.
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0}
        yarn |= {"truncate": False, "original_max_position_embeddings": 128}
        kwargs = COMMON | dict(head_dim=64, intermediate_size=32, num_hidden_layers=2, sliding_window=8)
        kwargs |= dict(num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0, max_position_embeddings=512)
        return transformers.GptOssConfig(**(kwargs | dict(rope_parameters=yarn) | overrides))
    raise ValueError(f"expected a family in {FAMILIES}, got {family!r}")


def tiny_model(family: str, *, seed: int | None = None, **overrides) -> torch.nn.Module:
    """transformers' float32 model of ``tiny_config(family, **overrides)`` with random weights from
    ``torch.manual_seed(seed)`` (default ``SEEDS[family]``); this reseeds torch's global generator."""
    from transformers import AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

    config = tiny_config(family, **overrides)
    torch.manual_seed(SEEDS[family] if seed is None else seed)
    if family in VISION_FAMILIES:
        return Qwen2_5_VLForConditionalGeneration(config)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        if family in ("qwen2", "qwen2_moe"):
            for name, param in model.named_parameters():
                if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                    param.normal_(0.0, 0.2)
        if family == "deepseek_v3":  # norms and expert-score biases away from their neutral init
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.3 * torch.randn_like(param))
            for layer in model.model.layers[config.first_k_dense_replace :]:
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.1 * torch.randn_like(bias))
        if family == "gpt_oss":  # attention and expert biases (zero at init), sinks of either sign
            for name, param in model.named_parameters():
                if name.endswith(("_proj.bias", "_proj_bias")):
                    param.normal_(0.0, 0.2)
                elif name.endswith("self_attn.sinks"):
                    param.normal_(0.0, 1.0)
                if name.endswith("experts.gate_up_proj"):  # pre-activations of std ~6: the limit of 7 clamps
                    param.mul_(GPT_OSS_GATE_UP_GAIN)
        if family in ("gemma2", "gemma3"):  # (1 + w) norms (w = 0 at init)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    return model


def save_quietly(model, path: str | Path) -> None:
    """``model.save_pretrained(path)`` without transformers' "Writing model shards" progress bar (a tiny
    checkpoint is one shard; the bar would land in a command's or a test's captured output)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def save_tiny_checkpoint(family: str, path: str | Path, *, seed: int | None = None, **overrides) -> str:
    """Save :func:`tiny_model` with ``save_pretrained`` (config.json, model.safetensors) under ``path``;
    returns ``str(path)``."""
    save_quietly(tiny_model(family, seed=seed, **overrides), path)
    return str(path)


_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., cols]`` (cols a multiple of 32) -> MXFP4 ``(blocks [..., cols/32, 16], scales
    [..., cols/32])`` uint8: per group of 32 values, the smallest power of two that brings the group
    within FP4's ±6 (biased by 127), and each value rounded to the nearest FP4 number (two codes per
    byte, the low nibble first)."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)  # [..., G, 32]
    amax = groups.abs().amax(dim=-1)  # [..., G]
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(_FP4_VALUES)).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks, (exponent + 127).to(torch.uint8)


def save_tiny_mxfp4_checkpoint(path: str | Path, *, seed: int | None = None, **overrides) -> str:
    """The tiny gpt-oss checkpoint with its experts stored as gpt-oss's released checkpoints store them:
    ``mlp.experts.{gate_up,down}_proj_{blocks,scales}`` (:func:`quantize_mxfp4` of the ``[E, out, in]``
    matrices) and ``quantization_config = {"quant_method": "mxfp4", ...}``; returns ``str(path)``."""
    import json

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


FP8_E4M3_MAX = 448.0


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` -> ``(float8_e4m3fn weight [R, C], float32 scales)``: one scale per ``block`` of
    ``(bm, bn)`` values (``[ceil(R / bm), ceil(C / bn)]``, the last blocks partial), or one for the
    whole tensor (``block`` None, a 0-dim scale); each scale maps its block's largest magnitude to 448."""
    if block is None:
        scale = (w.abs().max() / FP8_E4M3_MAX).clamp(min=1e-12).float()
        return (w / scale).to(torch.float8_e4m3fn), scale
    (bm, bn), (rows, cols) = block, w.shape
    nr, nc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(nr * bm, nc * bn, dtype=torch.float32)
    padded[:rows, :cols] = w
    amax = padded.view(nr, bm, nc, bn).abs().amax(dim=(1, 3))  # [nr, nc]
    scale = (amax / FP8_E4M3_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:rows, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def save_tiny_fp8_checkpoint(
    family: str, path: str | Path, *, block: tuple[int, int] | None = (16, 24), seed: int | None = None, **overrides
) -> tuple[str, str]:
    """``family``'s tiny checkpoint with every linear projection (``*_proj.weight``) stored in fp8 as
    FP8 checkpoints store them (:func:`quantize_fp8_blocks`: ``weight_scale_inv`` blocks, DeepSeek-V3's
    layout, or with ``block`` None a per-tensor ``weight_scale`` and an unused ``input_scale``), and
    ``quantization_config = {"quant_method": "fp8", ...}``. Returns ``(fp8 checkpoint, the same model
    unquantized with the dequantized weights)``: the second is what the first must compute."""
    import json

    from safetensors.torch import load_file, save_file

    path = Path(path)
    fp8_dir = Path(save_tiny_checkpoint(family, path / "fp8", seed=seed, **overrides))
    plain_dir = Path(save_tiny_checkpoint(family, path / "dequantized", seed=seed, **overrides))
    state = load_file(fp8_dir / "model.safetensors")
    plain = dict(state)
    for key in [k for k in state if k.endswith("_proj.weight") and state[k].dim() == 2]:
        weight, scale = quantize_fp8_blocks(state[key], block)
        state[key] = weight
        if block is None:
            state[f"{key}_scale"], state[key.removesuffix("weight") + "input_scale"] = scale, torch.ones(())
            plain[key] = weight.float() * scale
        else:
            state[f"{key}_scale_inv"] = scale
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            plain[key] = weight.float() * full[: weight.shape[0], : weight.shape[1]]
    save_file(state, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, plain_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static"}
    config["quantization_config"] = quant | ({"weight_block_size": list(block)} if block else {})
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return str(fp8_dir), str(plain_dir)


def image_prompts(prompts: list[list[int]], seed: int = 0) -> list[dict]:
    """Qwen2.5-VL prompts: each of ``prompts`` with a random ``IMAGE_GRID`` image (vision start, 16 pad
    tokens, vision end) after its first two tokens, as :meth:`portattn.LLM.generate` takes them.
    Token ids that collide with the special tokens are folded below ``VISION_START``."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = IMAGE_GRID
    out = []
    for prompt in prompts:
        ids = [x % VISION_START for x in prompt]
        image = [VISION_START, *[IMAGE_PAD] * (t * h * w // 4), VISION_END]
        data = {
            "pixel_values": torch.randn(t * h * w, PATCH_DIM, generator=g),  # [t*h*w, PATCH_DIM]
            "image_grid_thw": torch.tensor([IMAGE_GRID]),
        }
        out.append({"prompt_token_ids": ids[:2] + image + ids[2:], "multi_modal_data": data})
    return out


# -- vision towers alone -------------------------------------------------------------------------

VISION_TOWER_SIZES = {
    # The tower tests: head dim 16 (torch, sdpa) and head dim 80 (every backend, Qwen2.5-VL's real one).
    "d16": dict(hidden_size=64, num_heads=4, intermediate_size=96),
    "d80": dict(hidden_size=160, num_heads=2, intermediate_size=128),
    # The CPU benchmark: a tower small enough to time in seconds on two cores.
    "small": dict(depth=8, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=256)
    | dict(fullatt_block_indexes=[3, 7]),
    # Qwen2.5-VL-7B's tower.
    "real": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
    | dict(fullatt_block_indexes=[7, 15, 23, 31]),
}
_TOWER_TEST = dict(depth=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16)
_TOWER_TEST |= dict(out_hidden_size=32, fullatt_block_indexes=[1, 3])  # windows of 2 x 2 merge units
_TOWER_BENCH = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, hidden_act="silu")


def vision_tower_config(size: str):
    """transformers' ``Qwen2_5_VLVisionConfig`` of a tower alone: ``"d16"`` / ``"d80"`` (the tower tests:
    4 blocks, 2 of them full attention, patch 4) or ``"small"`` / ``"real"`` (the benchmark's: patch 14,
    window 112 pixels)."""
    from transformers import Qwen2_5_VLVisionConfig

    return Qwen2_5_VLVisionConfig(**_vision_tower_kwargs(size))


def _vision_tower_kwargs(size: str) -> dict:
    if size not in VISION_TOWER_SIZES:
        raise ValueError(f"expected a tower size in {list(VISION_TOWER_SIZES)}, got {size!r}")
    return (_TOWER_TEST if size in ("d16", "d80") else _TOWER_BENCH) | VISION_TOWER_SIZES[size]


def tiny_vision_tower_model(size: str, *, seed: int = 0) -> torch.nn.Module:
    """A Qwen2.5-VL model (one-layer text model, vocab 128) around ``vision_tower_config(size)``, its
    tower's weights drawn large enough that attention is far from uniform (a wrong window or a wrong
    permutation shows in the output): norms ``1 + 0.3·N(0, 1)``, biases ``N(0, 0.3²)``, matrices
    ``N(0, (1.5/√fan_in)²)``, from ``torch.manual_seed(seed)``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    text |= dict(num_key_value_heads=1, rope_parameters=mrope)
    vision = _vision_tower_kwargs(size)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for key, p in model.model.visual.named_parameters():
            if "norm" in key or "ln_q" in key:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif key.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 1.5 / p[0].numel() ** 0.5)
    return model


# -- transformers' outputs -----------------------------------------------------------------------


class TransformersOutput(NamedTuple):
    token_ids: list[int]  # greedy tokens, end-of-sequence ignored
    logits: torch.Tensor  # [len(token_ids), V] float32, the logits each token was chosen from
    prompt_logits: torch.Tensor  # [len(prompt), V] float32


def transformers_model(path: str | Path) -> torch.nn.Module:
    """transformers' float32 model of a checkpoint directory, in eval mode, with its end-of-sequence
    token cleared (the engine's counterpart is ``SamplingParams(ignore_eos=True)``).

    Attention is transformers' eager implementation: its SDPA path drops features SDPA lacks (Gemma 2's
    attention softcap is skipped under SDPA in transformers up to at least 5.17), so it is no reference."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    options = {}
    if (getattr(config, "quantization_config", None) or {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        options["quantization_config"] = Mxfp4Config(dequantize=True)  # dequantized to float32 as it loads
    model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **options).eval()
    model.float()  # transformers before 5.2x dequantizes MXFP4 to bfloat16 on the CPU (exactly: FP4 x 2^k)
    model.generation_config.eos_token_id = None
    return model


def transformers_generate(model: torch.nn.Module, prompt, max_new_tokens: int) -> TransformersOutput:
    """Greedy generation of ``model`` (from :func:`transformers_model`) on one prompt: a list of token
    ids, or ``{"prompt_token_ids": [...], "multi_modal_data": {"pixel_values", "image_grid_thw"}}``."""
    images = {}
    if isinstance(prompt, dict):
        prompt, images = prompt["prompt_token_ids"], dict(prompt["multi_modal_data"])
    ids = torch.tensor([list(prompt)])  # [1, n]
    image_token = getattr(model.config, "image_token_id", None)
    if image_token is not None:  # transformers 5 builds the 3-D rotary positions from the token types
        images["mm_token_type_ids"] = (ids == image_token).int()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 would otherwise be taken for padding
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **images,
        )
        prompt_logits = model(ids, **images).logits[0]
    return TransformersOutput(out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits), prompt_logits)


def transformers_greedy(path: str | Path, prompts: list, max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (as :func:`transformers_generate` takes them)."""
    model = transformers_model(path)
    return [transformers_generate(model, prompt, max_tokens).token_ids for prompt in prompts]
