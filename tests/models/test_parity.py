"""Greedy tokens and logits of the engine equal transformers' own, for every registered family
(``tiny_models.PARITY_FAMILIES``), at page sizes 1, 7 and 16, with and without prefix caching and
chunked prefill (the matrix of :mod:`.family_parity`). Family-specific checks live in each family's
``test_<family>.py``.

The prompts' lengths are 1, short, just below the Llama 4 chunk (32) and past it: decodes cross the
chunk boundary."""

from __future__ import annotations

import pytest

from tiny_models import PARITY_FAMILIES, checkpoint

from .family_parity import assert_matches_transformers


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked8"])
@pytest.mark.parametrize("prefix", [False, True], ids=["noprefix", "prefix"])
@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_matches_transformers(family, page_size, prefix, chunked, ckpt_root):
    assert_matches_transformers(checkpoint(family, ckpt_root), page_size, prefix, chunked)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "llama4", "gpt_oss", "deepseek_v3"])
def test_experts_with_gate_and_up_halves_match_transformers(family, ckpt_root, monkeypatch):
    """``moe.EXPERTS_INTERLEAVED`` off: the loader keeps each expert's gate and up rows in two halves
    from per-expert (Qwen3-MoE, Mixtral, DeepSeek V3) and stacked (Llama 4) checkpoints, gpt-oss's
    alternate as its checkpoint has them, and every path reads the layout: transformers' tokens and
    logits (the default, alternating rows, is what the other parity tests load)."""
    from portattn.models.layers import moe

    monkeypatch.setattr(moe, "EXPERTS_INTERLEAVED", False)
    if family == "deepseek_v3":
        from .test_deepseek_v3 import checkpoint as deepseek_checkpoint

        path = deepseek_checkpoint("yarn", ckpt_root)
    else:
        path = checkpoint(family, ckpt_root)
    llm = assert_matches_transformers(path, 7, False, True)
    layouts = {m.gate_up_interleaved for m in llm.engine.model.modules() if isinstance(m, moe.FusedMoE)}
    assert layouts == {family == "gpt_oss"}
