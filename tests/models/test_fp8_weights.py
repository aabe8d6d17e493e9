"""FP8 weight checkpoints (``quant_method: fp8``, block-wise as DeepSeek-V3 and Qwen3 "-FP8" store them,
or per tensor) are dequantized at load: the engine computes exactly what it computes on the same model
stored unquantized with the dequantized weights, whose greedy tokens equal transformers'."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.models import loader
from portattn.testing import quantize_fp8_blocks, save_tiny_fp8_checkpoint
from tiny_models import hf_reference, random_prompts

PROMPTS = random_prompts([3, 11, 26])


def generate(path: str, **kwargs):
    llm = LLM(path, page_size=7, num_pages=64, max_model_len=128, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, return_logits=True)
    return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize(
    "family, block",
    [("llama", (16, 24)), ("deepseek_v3", (16, 24)), ("qwen3_moe", (32, 32)), ("llama", None)],
    ids=["llama-blocks-16x24", "deepseek_v3-blocks-16x24", "qwen3_moe-blocks-32", "llama-per-tensor"],
)
def test_fp8_weights_compute_the_dequantized_model(family, block, tmp_path):
    fp8, dequantized = save_tiny_fp8_checkpoint(family, tmp_path, block=block)
    got, want = generate(fp8), generate(dequantized)
    for g, w, prompt in zip(got, want, PROMPTS):
        assert g.token_ids == w.token_ids == hf_reference(dequantized, tuple(prompt), 8)[0]
        assert torch.equal(g.logits, w.logits)


def test_the_weights_are_the_blocks_times_their_scales(tmp_path):
    """Ragged blocks (64 columns in blocks of 24): each value is its fp8 code times its block's scale."""
    fp8, _ = save_tiny_fp8_checkpoint("llama", tmp_path, block=(16, 24))
    ours = LLM(fp8, num_pages=8, max_model_len=128).engine.model
    state = load_file(f"{fp8}/model.safetensors")
    code, scale = state["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert code.dtype == torch.float8_e4m3fn and list(scale.shape) == [-(-code.shape[0] // 16), -(-code.shape[1] // 24)]
    r, c = torch.arange(code.shape[0]) // 16, torch.arange(code.shape[1]) // 24
    assert torch.equal(ours.model.layers[0].mlp.down_proj.weight, code.float() * scale[r[:, None], c[None, :]])
    assert not torch.equal(code.float(), ours.model.layers[0].mlp.down_proj.weight)  # the scales are not 1


def test_quantize_fp8_blocks_round_trips_within_e4m3():
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(0))
    code, scale = quantize_fp8_blocks(w, (16, 24))
    full = scale.repeat_interleave(16, 0).repeat_interleave(24, 1)[:37, :50]
    assert ((code.float() * full - w).abs() <= 2**-4 * w.abs() + 1e-6).all()  # e4m3 keeps 3 mantissa bits


def test_other_quantizations_and_bad_fp8_checkpoints_are_refused(tmp_path):
    fp8, _ = save_tiny_fp8_checkpoint("llama", tmp_path)
    config_file = f"{fp8}/config.json"
    with open(config_file) as f:
        config = json.load(f)
    for quant, message in [
        (
            {"quant_method": "awq"},
            r"expected an unquantized checkpoint or quant_method in \['fp8'\] for LlamaForCausalLM, got awq",
        ),
        ({"quant_method": "fp8", "weight_block_size": [16]}, r"expected weight_block_size \[rows, cols\]"),
        (
            {"quant_method": "fp8", "weight_block_size": [32, 32]},
            r"down_proj.weight's scale blocks of shape \[\d+, \d+\], got \[\d+, \d+\]",
        ),
    ]:
        with open(config_file, "w") as f:
            json.dump(config | {"quantization_config": quant}, f)
        with pytest.raises(ValueError, match=message):
            LLM(fp8, num_pages=8, max_model_len=128)
    assert loader.fp8_weights_of(type("C", (), {})(), object) is None  # no quantization_config
