"""Loading checkpoints: sharded files, dtypes, tokenizers, and clear errors for what is not supported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.models import supported_architectures
from portattn.models.llama4 import Llama4ForCausalLM
from portattn.testing import tiny_config
from tiny_models import checkpoint, hf_reference, random_prompts, rel_err

PROMPT = random_prompts([11], seed=5)[0]


def test_sharded_checkpoint_matches_transformers(tmp_path, ckpt_root):
    hf = AutoModelForCausalLM.from_pretrained(checkpoint("llama4", ckpt_root))
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 3 and (tmp_path / "model.safetensors.index.json").exists()
    out = LLM(tmp_path, page_size=4, num_pages=32, max_model_len=128).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert out[0].token_ids == hf_reference(checkpoint("llama4", ckpt_root), tuple(PROMPT), 8)[0]


def test_bfloat16_weights_and_cache(ckpt_root):
    path = checkpoint("qwen3", ckpt_root)
    llm = LLM(path, dtype="bfloat16", page_size=16, num_pages=8, max_model_len=128)
    assert {p.dtype for p in llm.engine.model.parameters()} == {torch.bfloat16}
    assert llm.engine.kv_pool.kv_cache(0).k.dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
    logits = llm.generate([PROMPT], params, use_tqdm=False)[0].prompt_logits
    assert rel_err(logits, hf_reference(path, tuple(PROMPT), 1)[2]) < 0.05  # bf16 rounding, not a bug


def test_tokenizer_and_text(tmp_path, ckpt_root):
    path = Path(checkpoint("llama", ckpt_root))
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(253))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    llm = LLM(tmp_path, page_size=4, num_pages=32, max_model_len=128)
    prompt = " ".join(f"w{i}" for i in (5, 17, 42, 99))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    ids = llm.tokenizer(prompt)["input_ids"]
    assert out.prompt_token_ids == ids == [8, 20, 45, 102]
    assert out.token_ids == hf_reference(str(path), tuple(ids), 6)[0]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) and out.text


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    config = tiny_config("llama")
    config.architectures = ["NoSuchModelForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="expected a model architecture in") as err:
        LLM(tmp_path)
    assert all(name in str(err.value) for name in supported_architectures())
    assert "Llama4ForCausalLM" in supported_architectures()


def test_bad_inputs_raise(tmp_path, ckpt_root):
    with pytest.raises(ValueError, match=r"config\.json"):
        LLM(tmp_path)
    path = checkpoint("llama", ckpt_root)
    with pytest.raises(ValueError, match="expected dtype"):
        LLM(path, dtype="int8")
    with pytest.raises(ValueError, match="expected page_size"):
        LLM(path, page_size=0)
    llm = LLM(path, num_pages=8, max_model_len=128)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\)"):
        llm.generate([[1, 256]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], use_tqdm=False)


def test_missing_weight_is_named(tmp_path, ckpt_root):
    src = Path(checkpoint("qwen3", ckpt_root))
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_norm.weight'\]"):
        LLM(tmp_path)


def test_old_rotary_buffers_in_checkpoints_are_skipped(tmp_path, ckpt_root):
    src = Path(checkpoint("llama", ckpt_root))
    state = load_file(src / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    out = LLM(tmp_path, num_pages=8, max_model_len=128).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert out[0].token_ids == hf_reference(str(src), tuple(PROMPT), 5)[0]
    state["model.layers.0.self_attn.extra.weight"] = torch.ones(8)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        LLM(tmp_path)


def test_llama4_multimodal_checkpoint_names():
    with torch.device("meta"):
        model = Llama4ForCausalLM(tiny_config("llama4"))
    assert model.checkpoint_name("language_model.model.layers.0.self_attn.q_proj.weight") == (
        "model.layers.0.self_attn.qkv_proj.weight",
        "q",
    )
    assert model.checkpoint_name("language_model.lm_head.weight") == ("lm_head.weight", None)
    assert model.checkpoint_name("vision_model.patch_embedding.linear.weight") is None
    assert model.checkpoint_name("multi_modal_projector.linear_1.weight") is None
