"""portattn.testing's tiny checkpoints: cheap to import, one config per family with the features it claims."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from portattn.models import supported_architectures
from portattn.testing import (
    ARCHITECTURES,
    DEEPSEEK_V3_VARIANTS,
    FAMILIES,
    IMAGE_GRID,
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    engine_families,
    image_prompts,
    tiny_config,
    tiny_model,
    vision_tower_config,
)


def test_importing_portattn_testing_does_not_import_transformers():
    code = "import sys, portattn.testing; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_importing_the_engine_does_not_import_transformers():
    """transformers comes where a checkpoint's config or tokenizer is read: its import takes about a
    second (AutoTokenizer's, in transformers 5.17, also the generation utilities: torch._dynamo,
    scikit-learn where installed), which ``import portattn`` and the engine's modules do not pay."""
    code = "import sys, portattn, portattn.engine.llm, portattn.server; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_the_architecture_it_names(family):
    config = tiny_config(family)
    assert config.get_text_config().vocab_size == 256
    for tied in (True, False):  # overrides reach the config
        assert tiny_config(family, tie_word_embeddings=tied).tie_word_embeddings is tied
    with torch.device("meta"):
        model = tiny_model(family)
    assert type(model).__name__ == ARCHITECTURES[family]


def test_engine_families_are_the_registered_ones():
    assert set(engine_families()) == {f for f in FAMILIES if ARCHITECTURES[f] in supported_architectures()}
    assert {"llama", "qwen3", "llama4", "deepseek_v3", "qwen2_5_vl"} <= set(engine_families())


def test_qwen2_has_biases_and_a_window_that_prompts_cross():
    config = tiny_config("qwen2")
    assert config.layer_types == ["full_attention", "sliding_attention"] and config.sliding_window == 24
    model = tiny_model("qwen2")
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            assert proj.bias.abs().min() > 0  # drawn, not transformers' zero init


def test_deepseek_variants_replace_the_same_keys():
    assert DEEPSEEK_V3_VARIANTS["yarn"].keys() == DEEPSEEK_V3_VARIANTS["plain"].keys()
    plain = tiny_config("deepseek_v3", **DEEPSEEK_V3_VARIANTS["plain"])
    assert plain.q_lora_rank is None and plain.rope_parameters["rope_type"] == "default"
    assert tiny_config("deepseek_v3").rope_parameters["rope_type"] == "yarn"


def test_image_prompts_hold_one_image_each():
    (prompt,) = image_prompts([[1, 2, 248, 250, 3]])
    t, h, w = IMAGE_GRID
    pads = t * h * w // 4
    assert prompt["prompt_token_ids"] == [1, 2, VISION_START, *[IMAGE_PAD] * pads, VISION_END, 0, 2, 3]
    assert prompt["multi_modal_data"]["pixel_values"].shape == (t * h * w, 96)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match=r"expected a family in \(.*'qwen2'.*\), got 'gpt2'"):
        tiny_config("gpt2")
    with pytest.raises(ValueError, match=r"expected a tower size in \['d16', 'd80', 'small', 'real'\], got 'huge'"):
        vision_tower_config("huge")
