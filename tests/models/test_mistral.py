"""Mistral through the engine: a sliding window on every layer, equal to transformers' own."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.testing import save_tiny_checkpoint, tiny_config
from tiny_models import checkpoint


def test_every_layer_has_the_window(ckpt_root):
    window = tiny_config("mistral").sliding_window
    layers = LLM(checkpoint("mistral", ckpt_root), num_pages=8, max_model_len=128).engine.model.attention_specs()
    assert [layer.window_left for layer in layers] == [window - 1] * len(layers)
    assert {layer.features for layer in layers} == {frozenset({"window"})}


def test_no_window_is_full_attention(tmp_path):
    path = save_tiny_checkpoint("mistral", tmp_path, sliding_window=None)
    layers = LLM(path, num_pages=8, max_model_len=128).engine.model.attention_specs()
    assert [layer.window_left for layer in layers] == [-1] * len(layers)


@pytest.mark.parametrize("window", [0, -3])
def test_bad_window_raises(tmp_path, window):
    config = tiny_config("mistral")
    config.sliding_window = window
    config.architectures = ["MistralForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="expected sliding_window None or >= 1"):
        LLM(tmp_path)
