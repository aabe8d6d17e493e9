"""The engine's configuration, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_KV_CACHE_MEMORY = 512 << 20  # bytes, when neither num_pages nor kv_cache_memory is given


@dataclass(frozen=True)
class EngineConfig:
    """Arguments of :class:`portattn.LLM`; ``dtype`` and ``device`` resolved to torch objects.

    ``num_pages`` None sizes the pool from ``kv_cache_memory`` bytes (default 512 MiB), capped at
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use. ``max_model_len`` None means
    the model's ``max_position_embeddings`` (capped by the pool). ``chunked_prefill_size`` is the
    token budget of one forward (None: unlimited, prompts run whole). ``mm_attention_backend`` is
    the varlen backend for vision encoders (kept for multimodal models; text models do not use it).
    """

    model: str
    device: torch.device
    dtype: torch.dtype
    page_size: int = 16
    attention_backend: str = "auto"
    mm_attention_backend: str = "auto"
    max_num_seqs: int = 64
    num_pages: int | None = None
    chunked_prefill_size: int | None = None
    enable_prefix_caching: bool = False
    max_model_len: int | None = None
    kv_cache_memory: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"expected dtype in {list(DTYPES)}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.dtype not in DTYPES.values():
            raise ValueError(f"expected dtype in {list(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "device", torch.device(self.device))
        for name in ("page_size", "max_num_seqs"):
            _positive(name, getattr(self, name))
        for name in ("num_pages", "chunked_prefill_size", "max_model_len", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("attention_backend", "mm_attention_backend"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"expected {name} to be a backend name or 'auto', got {getattr(self, name)!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")
