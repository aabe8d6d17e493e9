"""The engine's configuration, validated once; ``"auto"`` values are resolved here, before freezing."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch

from ..device import default_device, is_gpu, resolve_device
from ..kv_quant import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from ..models.hub import checkpoint_dtype, resolve_checkpoint
from ..quantization import QUANTIZATIONS, check_quantization
from .arguments import doc, option
from .memory import CPU_KV_CACHE_MEMORY, parse_bytes
from .spec_decode.config import SpeculativeConfig

logger = logging.getLogger("portattn")

# dtype names (vLLM's spellings); "auto" is resolved by auto_dtype.
DTYPES = {
    "auto": None,
    "half": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
    "float64": torch.float64,
}
DEFAULT_MAX_NUM_SEQS = 64
# Tokens per step when max_num_batched_tokens is not given: vLLM's serving default on GPUs; on the CPU
# a step of 2048 tokens already takes seconds, and a smaller one keeps decodes moving beside prefills.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"accelerator": 8192, "cpu": 2048}


def auto_dtype(model: str, device: torch.device) -> torch.dtype:
    """``dtype="auto"``: float32 on the CPU (CPUs compute half precision slowly or by emulation, and
    float32 is what transformers runs there); on an accelerator the dtype the checkpoint's config
    names (``dtype`` / ``torch_dtype``), float32 when it names none, and bfloat16 for a GGUF file
    (its weights are quantized or 16-bit: it names no compute dtype)."""
    if device.type == "cpu":
        return torch.float32
    if str(model).endswith(".gguf"):
        return torch.bfloat16
    return checkpoint_dtype(model) or torch.float32


@dataclass(frozen=True)
class EngineConfig:
    """Arguments of :class:`portattn.LLM` and flags of ``portattn generate``, one field each (help text
    in the field's metadata); ``model`` becomes a ``str``, ``dtype`` and ``device`` torch objects."""

    model: str = field(
        metadata=doc(
            "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer), a .gguf file, or a "
            "model id (org/name) already in the local Hugging Face cache"
        )
    )
    tokenizer: str | None = field(
        default=None, metadata=doc("tokenizer directory or .gguf file in place of the model's (default: the model's)")
    )
    device: str | torch.device = field(
        default="auto",
        metadata=doc(
            "torch device: auto ($PORTATTN_DEVICE if set, else the accelerator if there is one, else cpu), cpu, "
            "cuda, cuda:1, xpu, ..."
        ),
    )
    dtype: str | torch.dtype = field(
        default="auto",
        metadata=doc(
            "weights, activations, KV cache; auto: the checkpoint's dtype on an accelerator, float32 on the CPU",
            choices=DTYPES,
        ),
    )
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
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=doc(
            "tokens per step: decodes first, then prompt chunks fill the rest (longer prompts are prefilled in "
            f"chunks); default {DEFAULT_MAX_NUM_BATCHED_TOKENS['accelerator']} on accelerators, "
            f"{DEFAULT_MAX_NUM_BATCHED_TOKENS['cpu']} on the CPU"
        ),
    )
    chunked_prefill_size: int | None = field(
        default=None, metadata=doc("the same as max_num_batched_tokens (the older name; give one of the two)")
    )
    long_prefill_token_threshold: int = field(
        default=0,
        metadata=doc(
            "a prompt computes at most this many tokens a step (0: up to the token budget); small chunks beside "
            "running decodes keep their inter-token latency even (vLLM's flag). Where the capped chunks would "
            "fill the budget anyway, a prompt whose rest fits in the step computes it all (the step is as long)"
        ),
    )
    max_num_partial_prefills: int = field(
        default=1,
        metadata=doc(
            "at most this many prompts a step compute a chunk that leaves them unfinished, oldest first (vLLM's "
            "flag and default; 0: no limit); with long_prefill_token_threshold, prompts that arrive together enter "
            "the running decodes one after another instead of all lengthening the same steps (without it, at most "
            "one prompt a step can be left unfinished anyway)"
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=doc("share full KV-cache pages of equal prefixes between requests")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=doc("longest prompt + output (default: max_position_embeddings); the pool must hold one such request"),
    )
    allow_long_max_model_len: bool = field(
        default=False, metadata=doc("accept a max_model_len above the model's max_position_embeddings")
    )
    kv_cache_memory: int | str | None = field(
        default=None,
        metadata=doc(
            "KV-cache bytes without num_pages: 4G, 4GiB, 512MiB, 1.5GB or plain bytes (default: on an accelerator "
            f"what gpu_memory_utilization leaves; on the CPU {CPU_KV_CACHE_MEMORY >> 30} GiB)",
            parse=parse_bytes,
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=doc(
            "fraction of an accelerator's memory for weights, activations, graphs and the KV cache, which "
            "takes what the others leave (unless num_pages or kv_cache_memory)"
        ),
    )
    enforce_eager: bool = field(
        default=False, metadata=doc("run every step eagerly (default: decode steps replay captured CUDA/XPU graphs)")
    )
    lazy_graph_capture: bool = field(
        default=False,
        metadata=doc(
            "capture each decode graph the first time a step of its batch size runs (default: all at start; "
            "lazily, start-up is shorter and the first step of each size pays its capture)"
        ),
    )
    piecewise_graphs: bool = field(
        default=False,
        metadata=doc(
            "run steps that no decode graph replays (prompt chunks, decodes beside a chunk) of up to "
            "piecewise_max_tokens tokens as captured graphs of everything but attention, with attention launched "
            "between them from the step's plan (docs/engine.md); CUDA, one process, models without routed experts "
            "or images"
        ),
    )
    piecewise_max_tokens: int | None = field(
        default=None,
        metadata=doc(
            "with piecewise_graphs: the largest step (in tokens, up to the token budget) that replays captured "
            "pieces (default 512); buckets of 32, 64, ..., 512, then doubling to it. A larger one takes mixed "
            "steps of bigger prompt chunks off the host's launches and holds more memory (about 0.5 MB a token "
            "on the Llama-3-8B shape)"
        ),
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=doc(
            "launch the next step before reading this one's tokens, where the scheduler can make it from the known "
            "tokens (each token in flight decoded from its id on the device; not for penalties, processors, bad "
            "words, log-probabilities, a min_tokens ban, prompt logits or kept logits, nor where it would preempt): "
            "the host's work then overlaps the device's; outputs arrive one step later; the tokens are those of "
            "synchronous steps. Default: on where it can run (an accelerator "
            "with captured decode graphs, one process, no speculative decoding), as vLLM's; True with speculative "
            "decoding or several processes is an error, True without captured graphs is off with a warning; "
            "False: never"
        ),
    )
    enable_cascade_attn: bool = field(
        default=True,
        metadata=doc(
            "attend captured decode steps of at least 8 sequences that share a long prefix through a cascade (the "
            "shared KV pages read once for the batch, in the graph's cascade shape) where it saves at least 4 GiB of "
            "key reads; eager steps attend plainly (docs/engine.md). False: never"
        ),
    )
    tensor_parallel_size: int = field(
        default=1, metadata=doc("devices the model is sharded over, one process each (device names the first)")
    )
    kv_cache_dtype: str | torch.dtype = field(
        default="auto",
        metadata=doc(
            "KV-cache dtype: auto (the model's dtype) or fp8 (half the bytes; fp8 is fp8_e4m3, as in vLLM); fp8 "
            "scales per layer from the checkpoint's self_attn.k_scale / v_scale, else 1.0",
            choices=KV_CACHE_DTYPES,
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=doc(
            "fp8: the decoder's linear layers in float8 e4m3, weights quantized at load (a scale per output "
            "feature) and inputs at each step (a scale per token), matmuls on fp8 tensor cores (as vLLM's "
            "--quantization fp8 of a 16-bit checkpoint; docs/engine.md). Default: the model's dtype",
            choices=QUANTIZATIONS,
        ),
    )
    seed: int | None = field(
        default=None, metadata=doc("the seed of requests whose SamplingParams have none (default: random)")
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
        object.__setattr__(self, "model", resolve_checkpoint(os.fspath(self.model)))
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)):
                raise ValueError(
                    f"expected tokenizer to be a directory or .gguf file (str or path), got {self.tokenizer!r}"
                )
            object.__setattr__(self, "tokenizer", resolve_checkpoint(os.fspath(self.tokenizer)))
        if not isinstance(self.generation_config, (str, os.PathLike)) or not os.fspath(self.generation_config):
            raise ValueError(
                f"expected generation_config to be 'auto', 'vllm' or a folder path, got {self.generation_config!r}"
            )
        object.__setattr__(self, "generation_config", os.fspath(self.generation_config))
        if self.device == "auto":
            chosen = os.environ.get("PORTATTN_DEVICE") or None
            object.__setattr__(self, "device", chosen or default_device())
            why = "$PORTATTN_DEVICE" if chosen else "the accelerator" if is_gpu(self.device) else "no accelerator here"
            logger.info("device auto: %s (%s)", self.device, why)
        object.__setattr__(self, "device", resolve_device(self.device))
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"expected {option('dtype')} in {list(DTYPES)}, got {self.dtype!r}")
            resolved = DTYPES[self.dtype] or auto_dtype(self.model, self.device)
            object.__setattr__(self, "dtype", resolved)
        if self.dtype not in DTYPES.values():
            raise ValueError(f"expected {option('dtype')} in {list(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.kv_cache_dtype, (str, torch.dtype)):
            raise ValueError(f"expected kv_cache_dtype in {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        object.__setattr__(self, "kv_cache_dtype", resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype))
        check_quantization(self.quantization, self.dtype)
        if isinstance(self.kv_cache_memory, str):
            try:
                object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
            except ValueError as exc:
                raise ValueError(f"{option('kv_cache_memory')}: {exc}") from None
        for name in ("page_size", "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        sizes = ("max_num_seqs", "num_pages", "max_num_batched_tokens", "chunked_prefill_size", "max_model_len")
        if self.piecewise_max_tokens is not None:
            _positive("piecewise_max_tokens", self.piecewise_max_tokens)
            if self.piecewise_graphs is not True:
                raise ValueError(
                    f"expected {option('piecewise_graphs')} with {option('piecewise_max_tokens')}, got "
                    f"piecewise_graphs {self.piecewise_graphs!r}"
                )
        for name in (*sizes, "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("long_prefill_token_threshold", "max_num_partial_prefills"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"expected {option(name)} to be an int >= 0, got {value!r}")
        flags = ("enable_prefix_caching", "allow_long_max_model_len", "enforce_eager", "lazy_graph_capture")
        flags += ("piecewise_graphs",)
        for name in (*flags, "enable_cascade_attn"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {option(name)} to be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.async_scheduling, (bool, type(None))):
            got = self.async_scheduling
            raise ValueError(f"expected {option('async_scheduling')} to be None (auto) or a bool, got {got!r}")
        utilization = self.gpu_memory_utilization
        if not (isinstance(utilization, (int, float)) and not isinstance(utilization, bool) and 0 < utilization <= 1):
            raise ValueError(f"expected {option('gpu_memory_utilization')} in (0, 1], got {utilization!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            raise ValueError(f"expected {option('seed')} to be None or an int, got {self.seed!r}")
        if self.max_num_seqs is None:
            auto = DEFAULT_MAX_NUM_SEQS if self.num_pages is None else min(DEFAULT_MAX_NUM_SEQS, self.num_pages)
            object.__setattr__(self, "max_num_seqs", auto)
        self._resolve_token_budget()
        if self.speculative_config is not None:
            spec = SpeculativeConfig.parse(self.speculative_config)
            if spec.model is not None:  # a draft given as a model id: its snapshot in the local cache
                spec = dataclasses.replace(spec, model=resolve_checkpoint(spec.model))
            object.__setattr__(self, "speculative_config", spec)
        if self.async_scheduling and (self.speculative_config is not None or self.tensor_parallel_size > 1):
            got = "speculative_config" if self.speculative_config is not None else "tensor_parallel_size"
            raise ValueError(
                f"expected {option('async_scheduling')} in one process without speculative decoding, got {got} "
                f"{getattr(self, got) if got == 'tensor_parallel_size' else 'set'}"
            )
        for name in ("attention_backend", "mm_attention_backend"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"expected {name} to be a backend name or 'auto', got {getattr(self, name)!r}")

    def _resolve_token_budget(self) -> None:
        """``max_num_batched_tokens`` and its older name ``chunked_prefill_size`` end up equal."""
        budget, alias = self.max_num_batched_tokens, self.chunked_prefill_size
        if budget is not None and alias is not None and budget != alias:
            raise ValueError(
                f"expected one token budget, got {option('max_num_batched_tokens')} {budget} and "
                f"{option('chunked_prefill_size')} {alias} (the older name of the same thing)"
            )
        if budget is None:
            kind = "cpu" if self.device.type == "cpu" else "accelerator"
            budget = alias if alias is not None else DEFAULT_MAX_NUM_BATCHED_TOKENS[kind]
        object.__setattr__(self, "max_num_batched_tokens", budget)
        object.__setattr__(self, "chunked_prefill_size", budget)


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"expected {option(name)} to be a positive int, got {value!r}")
