"""Phi-3 / Phi-4 through the engine: the fused ``qkv_proj`` and ``gate_up_proj`` checkpoint tensors
load into the merged layers row for row, and what this engine does not compute is refused at load
(the parity matrix against transformers is in test_parity.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from portattn.engine.llm import LLM
from portattn.testing import tiny_config
from tiny_models import checkpoint


def test_fused_tensors_load_row_for_row(ckpt_root):
    path = checkpoint("phi3", ckpt_root)
    layer = LLM(path, num_pages=8, max_model_len=128).engine.model.model.layers[1]
    state = load_file(f"{path}/model.safetensors")
    assert torch.equal(layer.self_attn.qkv_proj.weight, state["model.layers.1.self_attn.qkv_proj.weight"])
    gate_up = layer.mlp.gate_up_proj  # gate and up rows alternate here, [gate; up] in the checkpoint
    rows = torch.cat([part.t() for part in gate_up.split(gate_up.weight.t())])
    assert torch.equal(rows, state["model.layers.1.mlp.gate_up_proj.weight"])
    assert layer.self_attn.spec.window_left == tiny_config("phi3").sliding_window - 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
         r"expected rotary embeddings over the whole head dim 16, got 12"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                              "long_factor": [1.0] * 8, "original_max_position_embeddings": 512}},
         r"expected a rope_type in .*, got 'longrope'"),
    ],
    ids=["partial-rotary", "longrope"],
)  # fmt: skip
def test_rotary_it_does_not_compute_is_refused(overrides, message, tmp_path):
    config = tiny_config("phi3", **overrides)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(tmp_path, num_pages=8, max_model_len=128)
