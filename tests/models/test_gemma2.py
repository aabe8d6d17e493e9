"""Gemma 2 through the engine: attention and final logit softcaps, ``query_pre_attn_scalar`` as the
softmax scale, alternating local and global layers, ``(1 + w)`` pre- and post-norms, scaled
embeddings; equal to transformers' own."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.testing import tiny_config
from tiny_models import checkpoint


def test_layers_alternate_local_and_global(ckpt_root):
    config = tiny_config("gemma2")
    layers = LLM(checkpoint("gemma2", ckpt_root), num_pages=8, max_model_len=128).engine.model.attention_specs()
    assert [layer.window_left for layer in layers] == [config.sliding_window - 1, -1]
    assert [layer.features for layer in layers] == [frozenset({"window", "softcap"}), frozenset({"softcap"})]
    assert {layer.logit_softcap for layer in layers} == {config.attn_logit_softcapping}
    assert {layer.scale for layer in layers} == {config.query_pre_attn_scalar**-0.5}


def test_bidirectional_attention_is_refused(tmp_path):
    config = tiny_config("gemma2", use_bidirectional_attention=True)
    config.architectures = ["Gemma2ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="expected causal attention"):
        LLM(tmp_path)
