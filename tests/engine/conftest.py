"""Tiny random checkpoints of each supported family, saved with ``save_pretrained``, and the
``transformers`` outputs the engine must reproduce."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Llama4TextConfig, LlamaConfig, Qwen3Config

COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)

CONFIGS = {
    # llama3 rope scaling and tied embeddings.
    "llama": lambda: LlamaConfig(
        **COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k norm; the second layer has a sliding window of 24 tokens.
    "qwen3": lambda: Qwen3Config(
        **COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=24,
        max_window_layers=1,
    ),
    # Chunked RoPE layers (0, 2) with chunk 32, NoPE layers (1, 3) with temperature tuning, MoE on
    # layers 1 and 3 (4 experts, top-1, shared expert), dense MLPs on 0 and 2.
    "llama4": lambda: Llama4TextConfig(
        **COMMON,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=32,
        floor_scale=8,
        attn_scale=0.5,
    ),
}
FAMILIES = list(CONFIGS)
# Where the parity tests run the engine (transformers' reference stays on the CPU, in float32):
# the CPU in CI; `PORTATTN_TEST_ENGINE_DEVICE=cuda` runs them with the GPU's default backend.
ENGINE_DEVICE = os.environ.get("PORTATTN_TEST_ENGINE_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run thousands of small ops: with two xdist workers on two cores, intra-op threads
    only spin against each other (10x slower on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def checkpoint(family: str, root: str) -> str:
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]())
    path = f"{root}/{family}"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@functools.cache
def hf_model(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compared with SamplingParams(ignore_eos=True)
    return model


@functools.cache
def hf_reference(path: str, prompt: tuple[int, ...], max_new_tokens: int):
    """``(greedy tokens, logits of each generated token [N, V], prompt logits [n, V])`` from transformers."""
    model = hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 would otherwise be taken for padding
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        prompt_logits = model(ids).logits[0]
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits), prompt_logits


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max() / want.abs().max())


def worst_error_against_transformers(
    llm, path: str, prompts: list[list[int]], max_new: int, prompt_logits: bool
) -> float:
    """Generate greedily; assert the tokens equal transformers'; return the worst logit relative error."""
    from portattn.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new, ignore_eos=True, return_logits=True, return_prompt_logits=prompt_logits)
    worst = 0.0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens, logits, ref_prompt_logits = hf_reference(path, tuple(prompt), max_new)
        assert out.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        worst = max(worst, rel_err(out.logits, logits))
        if prompt_logits:
            worst = max(worst, rel_err(out.prompt_logits, ref_prompt_logits))
    return worst


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
