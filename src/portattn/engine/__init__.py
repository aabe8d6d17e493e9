"""The inference engine: requests -> scheduler -> one ForwardBatch per step -> model -> sampler.

``LLM`` and ``SamplingParams`` are imported lazily: ``import portattn`` stays cheap, and the op library
installs without the ``engine`` extra (transformers, safetensors, tqdm) that ``LLM`` needs.
"""

from __future__ import annotations

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from ..extras import require_extra

        require_extra("engine", f"portattn.{name}")
        from . import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
