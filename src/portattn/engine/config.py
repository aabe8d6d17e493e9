"""The engine's configuration, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..device import resolve_device
from ..kv_quant import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from .arguments import doc
from .spec_decode.config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_KV_CACHE_MEMORY = 512 << 20  # bytes, when neither num_pages nor kv_cache_memory is given
DEFAULT_MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class EngineConfig:
    """Arguments of :class:`portattn.LLM` and flags of ``portattn generate``, one field each (help text
    in the field's metadata); ``model`` becomes a ``str``, ``dtype`` and ``device`` torch objects."""

    model: str = field(
        metadata=doc("Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer) or a .gguf file")
    )
    tokenizer: str | None = field(
        default=None, metadata=doc("tokenizer directory or .gguf file in place of the model's (default: the model's)")
    )
    device: str | torch.device = field(
        default="cpu", metadata=doc("torch device: cpu, cuda, cuda:1, xpu, ...; must exist here")
    )
    dtype: str | torch.dtype = field(default="float32", metadata=doc("weights, activations, KV cache", choices=DTYPES))
    page_size: int = field(default=16, metadata=doc("tokens per KV-cache page, any positive int"))
    attention_backend: str = field(
        default="auto", metadata=doc("language-model attention backend; auto: $PORTATTN_ATTENTION_BACKEND or fastest")
    )
    mm_attention_backend: str = field(
        default="auto",
        metadata=doc("vision-encoder attention backend; auto: $PORTATTN_MM_ATTENTION_BACKEND or fastest"),
    )
    max_num_seqs: int | None = field(
        default=None,
        metadata=doc(f"most sequences scheduled at once (default: {DEFAULT_MAX_NUM_SEQS}, or num_pages if fewer)"),
    )
    num_pages: int | None = field(
        default=None,
        metadata=doc(
            "KV-cache pages (default: what kv_cache_memory holds, up to what max_num_seqs use); refused if "
            "fewer than one request of max_model_len or max_num_seqs requests of a page need"
        ),
    )
    chunked_prefill_size: int | None = field(
        default=None, metadata=doc("tokens per forward; longer prompts are prefilled in chunks (default: no limit)")
    )
    enable_prefix_caching: bool = field(default=False, metadata=doc("share full KV-cache pages of equal prefixes"))
    max_model_len: int | None = field(
        default=None,
        metadata=doc("longest prompt + output (default: max_position_embeddings); the pool must hold one such request"),
    )
    allow_long_max_model_len: bool = field(
        default=False, metadata=doc("accept a max_model_len above the model's max_position_embeddings")
    )
    kv_cache_memory: int | None = field(
        default=None, metadata=doc(f"KV-cache bytes without num_pages (default: {DEFAULT_KV_CACHE_MEMORY >> 20} MiB)")
    )
    enforce_eager: bool = field(
        default=False, metadata=doc("run every step eagerly (default: decode steps replay captured CUDA/XPU graphs)")
    )
    tensor_parallel_size: int = field(
        default=1, metadata=doc("devices the model is sharded over, one process each (device names the first)")
    )
    kv_cache_dtype: str | torch.dtype = field(
        default="auto",
        metadata=doc(
            "KV-cache dtype: auto (the model's dtype) or fp8 (half the bytes); fp8 scales per layer from the "
            "checkpoint's self_attn.k_scale / v_scale, else 1.0",
            choices=KV_CACHE_DTYPES,
        ),
    )
    generation_config: str = field(
        default="auto",
        metadata=doc(
            "sampling defaults of requests that do not set them: auto (the checkpoint's generation_config.json), "
            "vllm (vLLM's defaults), or a folder holding a generation_config.json"
        ),
    )
    speculative_config: str | dict | SpeculativeConfig | None = field(
        default=None,
        metadata=doc(
            'speculative decoding, vLLM\'s keys as a JSON object: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": DRAFT_CHECKPOINT, "num_speculative_tokens": '
            '4}; also "disable_by_batch_size"'
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"expected model to be a checkpoint directory (str or path), got {self.model!r}")
        object.__setattr__(self, "model", os.fspath(self.model))
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)):
                raise ValueError(
                    f"expected tokenizer to be a directory or .gguf file (str or path), got {self.tokenizer!r}"
                )
            object.__setattr__(self, "tokenizer", os.fspath(self.tokenizer))
        if not isinstance(self.generation_config, (str, os.PathLike)) or not os.fspath(self.generation_config):
            raise ValueError(
                f"expected generation_config to be 'auto', 'vllm' or a folder path, got {self.generation_config!r}"
            )
        object.__setattr__(self, "generation_config", os.fspath(self.generation_config))
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"expected dtype in {list(DTYPES)}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.dtype not in DTYPES.values():
            raise ValueError(f"expected dtype in {list(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "device", resolve_device(self.device))
        if not isinstance(self.kv_cache_dtype, (str, torch.dtype)):
            raise ValueError(f"expected kv_cache_dtype in {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        object.__setattr__(self, "kv_cache_dtype", resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype))
        for name in ("page_size", "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        for name in ("max_num_seqs", "num_pages", "chunked_prefill_size", "max_model_len", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("enable_prefix_caching", "allow_long_max_model_len", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be a bool, got {getattr(self, name)!r}")
        if self.max_num_seqs is None:
            auto = DEFAULT_MAX_NUM_SEQS if self.num_pages is None else min(DEFAULT_MAX_NUM_SEQS, self.num_pages)
            object.__setattr__(self, "max_num_seqs", auto)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in ("attention_backend", "mm_attention_backend"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"expected {name} to be a backend name or 'auto', got {getattr(self, name)!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")
