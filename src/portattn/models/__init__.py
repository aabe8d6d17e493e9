"""Model families, registered by Hugging Face architecture name and imported on first use.

A model class takes the transformers config and provides ``forward(input_ids, positions, ctx)``,
``compute_logits``, ``kv_cache_spec()`` and ``checkpoint_name()`` (see :class:`~portattn.models.base.CausalLM`);
it is built from ``models/layers/``. New families register here with :func:`register_model`.
"""

from __future__ import annotations

import importlib

_REGISTRY: dict[str, str] = {}


def register_model(architecture: str, target: str) -> None:
    """Register ``target`` (``"package.module:ClassName"``) for a config's ``architectures`` entry."""
    if architecture in _REGISTRY and _REGISTRY[architecture] != target:
        raise ValueError(f"architecture {architecture!r} is already registered as {_REGISTRY[architecture]}")
    _REGISTRY[architecture] = target


def registered_models() -> dict[str, str]:
    """Architecture -> ``"package.module:ClassName"``, for processes that must know the same models."""
    return dict(_REGISTRY)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architectures: list[str] | None) -> type:
    """The class for the first supported name in a config's ``architectures``."""
    for name in architectures or []:
        if name in _REGISTRY:
            module_name, class_name = _REGISTRY[name].split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"expected a model architecture in {supported_architectures()}, got {architectures}")


register_model("LlamaForCausalLM", "portattn.models.llama:LlamaForCausalLM")
register_model("Qwen2ForCausalLM", "portattn.models.qwen2:Qwen2ForCausalLM")
register_model("Qwen2MoeForCausalLM", "portattn.models.qwen2_moe:Qwen2MoeForCausalLM")
register_model("Qwen3ForCausalLM", "portattn.models.qwen3:Qwen3ForCausalLM")
register_model("Qwen3MoeForCausalLM", "portattn.models.qwen3_moe:Qwen3MoeForCausalLM")
register_model("Llama4ForCausalLM", "portattn.models.llama4:Llama4ForCausalLM")
register_model("Llama4ForConditionalGeneration", "portattn.models.llama4:Llama4ForCausalLM")
register_model("Qwen2_5_VLForConditionalGeneration", "portattn.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration")
register_model("DeepseekV3ForCausalLM", "portattn.models.deepseek_v3:DeepseekV3ForCausalLM")
register_model("MistralForCausalLM", "portattn.models.mistral:MistralForCausalLM")
register_model("MixtralForCausalLM", "portattn.models.mixtral:MixtralForCausalLM")
register_model("Phi3ForCausalLM", "portattn.models.phi3:Phi3ForCausalLM")
register_model("Gemma2ForCausalLM", "portattn.models.gemma2:Gemma2ForCausalLM")
register_model("Gemma3ForCausalLM", "portattn.models.gemma3:Gemma3ForCausalLM")
register_model("GptOssForCausalLM", "portattn.models.gpt_oss:GptOssForCausalLM")
