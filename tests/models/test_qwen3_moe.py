"""Qwen3-MoE through the engine: experts on the sparse layers, dense MLPs on the others, a window on
every layer when configured (the parity matrix against transformers is in test_parity.py)."""

from __future__ import annotations

import pytest

from portattn.engine.llm import LLM
from portattn.models.layers import FusedMoE, GatedMLP
from portattn.testing import save_tiny_checkpoint, tiny_config, transformers_model

VARIANTS = {
    "mlp-only-layer-1": {},
    "every-second-layer": {"decoder_sparse_step": 2, "mlp_only_layers": []},
    "no-window": {"use_sliding_window": False},
}


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_layers_are_those_transformers_builds(overrides, tmp_path):
    path = save_tiny_checkpoint("qwen3_moe", tmp_path, **overrides)
    config = tiny_config("qwen3_moe", **overrides)
    ours = LLM(path, num_pages=8, max_model_len=128).engine.model
    theirs = transformers_model(path)
    kinds = [
        "experts" if isinstance(getattr(layer.mlp, "experts", None), FusedMoE) else "dense"
        for layer in ours.model.layers
    ]
    want = [
        "experts" if type(layer.mlp).__name__.endswith("SparseMoeBlock") else "dense" for layer in theirs.model.layers
    ]
    assert kinds == want and "dense" in kinds and "experts" in kinds
    assert all(isinstance(layer.mlp, GatedMLP) for layer, kind in zip(ours.model.layers, kinds) if kind == "dense")
    window = config.sliding_window  # None unless use_sliding_window
    assert {layer.window_left for layer in ours.attention_specs()} == {-1 if window is None else window - 1}


def test_bad_routing_configs_are_refused(tmp_path):
    config = tiny_config("qwen3_moe", num_experts_per_tok=9)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"expected num_experts_per_tok in \[1, num_experts 8\], got 9"):
        LLM(tmp_path, num_pages=8, max_model_len=128)
