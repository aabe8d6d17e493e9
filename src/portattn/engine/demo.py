"""``portattn demo``: tiny random checkpoints of every family through the engine, checked against
transformers, offline and on the CPU.

For each family a small random model is built with transformers' own config class and saved with
``save_pretrained``; a batch of prompts then runs through the engine at several page sizes (and once
with prefix caching and chunked prefill), and the greedy tokens are compared with
``transformers``' ``generate`` on the same checkpoint.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def tiny_config(family: str):
    """A small random-weight config of ``family`` that exercises its distinctive features."""
    from transformers import DeepseekV3Config, Llama4TextConfig, LlamaConfig, Qwen3Config

    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(
            **TINY, intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=True, rope_parameters=rope
        )
    if family == "qwen3":
        return Qwen3Config(**TINY, intermediate_size=128, num_hidden_layers=4, head_dim=16)
    if family == "llama4":
        return Llama4TextConfig(
            **TINY,
            intermediate_size=64,
            intermediate_size_mlp=128,
            num_hidden_layers=4,
            head_dim=16,
            num_local_experts=4,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=32,
            floor_scale=8,
        )
    if family == "deepseek_v3":  # MLA with q LoRA and YaRN; a dense layer, then grouped top-k MoE
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
        rope |= {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        return DeepseekV3Config(
            **(TINY | {"num_key_value_heads": TINY["num_attention_heads"]}),
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            rope_parameters=rope,
        )
    if family == "qwen2_5_vl":  # mrope language model; vision tower with window and full-attention blocks
        from transformers import Qwen2_5_VLConfig

        mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, patch_size=4, spatial_merge_size=2)
        vision |= dict(temporal_patch_size=2, window_size=16, out_hidden_size=64, fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(
            text_config=TINY
            | dict(intermediate_size=128, num_hidden_layers=2, rope_parameters=mrope, bos_token_id=0, eos_token_id=1),
            vision_config=vision | dict(initializer_range=0.2),
            image_token_id=IMAGE_PAD,
            video_token_id=IMAGE_PAD + 1,
            vision_start_token_id=IMAGE_PAD + 2,
            vision_end_token_id=IMAGE_PAD + 3,
        )
    raise ValueError(f"expected a family in {FAMILIES + VISION_FAMILIES}, got {family!r}")


FAMILIES = ("llama", "qwen3", "llama4", "deepseek_v3")
VISION_FAMILIES = ("qwen2_5_vl",)  # prompts with a random image; transformers' image-text-to-text model
IMAGE_PAD, IMAGE_GRID, PATCH_DIM = 500, (1, 8, 8), 3 * 2 * 4 * 4  # pad token, image grid (t, h, w), C*T*P*P


def image_prompts(prompts: list[list[int]], seed: int = 0) -> list[dict]:
    """Each prompt with a random image's pad tokens after its first two tokens."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = IMAGE_GRID
    out = []
    for prompt in prompts:
        ids = [x % IMAGE_PAD for x in prompt]  # no image tokens in the text
        data = {
            "pixel_values": torch.randn(t * h * w, PATCH_DIM, generator=g),
            "image_grid_thw": torch.tensor([IMAGE_GRID]),
        }
        out.append({"prompt_token_ids": ids[:2] + [IMAGE_PAD] * (t * h * w // 4) + ids[2:], "multi_modal_data": data})
    return out


def save_tiny_checkpoint(family: str, path: str | Path, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family in VISION_FAMILIES else AutoModelForCausalLM
    auto.from_config(tiny_config(family)).save_pretrained(path)
    return str(path)


def transformers_greedy(path: str, prompts: list, max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if any(isinstance(p, dict) for p in prompts) else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            images = {}
            if isinstance(prompt, dict):
                prompt, images = prompt["prompt_token_ids"], dict(prompt["multi_modal_data"])
            ids = torch.tensor([prompt])
            if images:  # transformers builds the 3-D rotary positions from the token types
                images["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
            mask = torch.ones_like(ids)  # explicit: token 0 would otherwise be taken for padding
            seq = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **images
            )
            outs.append(seq[0, len(prompt) :].tolist())
    return outs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    families = FAMILIES + VISION_FAMILIES
    parser.add_argument("--families", nargs="+", default=list(families), choices=families)
    parser.add_argument("--page-sizes", nargs="+", type=int, default=[1, 7, 16])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--attention-backend", default="auto")


def main(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .llm import LLM
    from .sampling_params import SamplingParams

    hf_logging.set_verbosity_error()  # the reference runs' own progress bars and notes would bury the table
    hf_logging.disable_progress_bar()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 48, (args.num_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    runs = [(p, False, None) for p in args.page_sizes] + [(16, True, 16)]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} new tokens each\n")
    print(f"{'family':11} {'page':>4} {'prefix+chunk':>12} {'tokens/s':>9}  greedy == transformers")
    all_ok = True
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            path = save_tiny_checkpoint(family, Path(root) / family)
            inputs = image_prompts(prompts) if family in VISION_FAMILIES else prompts
            want = transformers_greedy(path, inputs, args.max_tokens)
            for page_size, prefix, chunk in runs:
                llm = LLM(
                    path,
                    page_size=page_size,
                    attention_backend=args.attention_backend,
                    enable_prefix_caching=prefix,
                    chunked_prefill_size=chunk,
                    num_pages=-(-len(prompts) * 96 // page_size),
                )
                start = time.perf_counter()
                outs = llm.generate(inputs, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                ok = [o.token_ids for o in outs] == want
                all_ok &= ok
                extra = "yes" if prefix else "no"
                rate = sum(len(o.token_ids) for o in outs) / seconds
                print(f"{family:11} {page_size:>4} {extra:>12} {rate:>9.0f}  {'yes' if ok else 'NO'}")
    print("\nall greedy outputs equal transformers'" if all_ok else "\nMISMATCH against transformers")
    return 0 if all_ok else 1
