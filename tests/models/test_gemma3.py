"""Gemma 3's text model through the engine: five local layers per global one, rotary bases per layer
type, q/k norms, no attention softcap; equal to transformers' own."""

from __future__ import annotations

import torch

from portattn.engine.llm import LLM
from portattn.testing import tiny_config
from tiny_models import checkpoint


def test_five_local_layers_per_global_one_with_their_own_rotary(ckpt_root):
    config = tiny_config("gemma3")
    model = LLM(checkpoint("gemma3", ckpt_root), num_pages=8, max_model_len=128).engine.model
    windows = [layer.window_left for layer in model.attention_specs()]
    assert windows == [config.sliding_window - 1] * 5 + [-1]
    assert {layer.logit_softcap for layer in model.attention_specs()} == {0.0}
    local, full = model.model.rotary_emb["sliding_attention"], model.model.rotary_emb["full_attention"]
    head_dim = config.head_dim
    exponents = torch.arange(0, head_dim, 2).float() / head_dim
    torch.testing.assert_close(local.inv_freq.cpu(), 1.0 / 10000.0**exponents, rtol=0, atol=0)
    torch.testing.assert_close(full.inv_freq.cpu(), 1.0 / 1000000.0**exponents / 8.0, rtol=1e-6, atol=0)
