"""Hugging Face checkpoint directories -> our model classes, tokenizer and stop tokens."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from . import model_class

logger = logging.getLogger("portattn")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"expected a Hugging Face checkpoint directory with config.json, got {str(path)!r}")
    return path


def load_config(path: str | Path):
    return AutoConfig.from_pretrained(_checkpoint_dir(path))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"expected *.safetensors files in {str(path)!r}, got none")
    return files


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, config=None, mm_attention_backend: str = "auto"
) -> torch.nn.Module:
    """Build the model for ``config.architectures`` and load its safetensors weights (sharded or not).

    A multimodal class (``is_multimodal``) also gets ``dtype``, ``device`` and ``mm_attention_backend``,
    to select its encoders' attention backend once, at construction.
    """
    path = _checkpoint_dir(path)
    config = config if config is not None else load_config(path)
    cls = model_class(getattr(config, "architectures", None))
    with torch.device("meta"):
        options = {}
        if getattr(cls, "is_multimodal", False):
            options = dict(dtype=dtype, device=device, mm_attention_backend=mm_attention_backend)
        model = cls(config, **options)
    expected = dict(model.named_parameters())
    float32 = getattr(model, "float32_weights", frozenset())  # kept in float32 whatever dtype (e.g. routers)
    state = {}
    files = safetensors_files(path)
    for file in tqdm(files, desc="loading weights", unit="shard", leave=False, disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = model.checkpoint_name(key)
                if name is None:
                    continue
                if name not in expected:
                    raise ValueError(f"expected checkpoint tensors of {cls.__name__}, got unknown tensor {key!r}")
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise ValueError(f"expected {key} of shape {list(expected[name].shape)}, got {list(tensor.shape)}")
                state[name] = tensor.to(device=device, dtype=torch.float32 if name in float32 else dtype)
    tied = {"lm_head.weight"} if model.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(state) - tied)
    if missing:
        raise ValueError(f"expected every weight of {cls.__name__} in the checkpoint, missing {missing[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.to(device)  # the rotary buffers, built on the CPU
    model.eval().requires_grad_(False)
    logger.info("loaded %s from %s (%s, %s)", cls.__name__, path, dtype, device)
    return model


def load_tokenizer(path: str | Path):
    """The directory's tokenizer through ``AutoTokenizer``, or ``None`` when it has none."""
    path = Path(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: str | Path, config) -> set[int]:
    """End-of-sequence ids from ``generation_config.json`` if present, else from the model config."""
    eos = None
    if (Path(path) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        text_config = getattr(config, "text_config", None) or config
        eos = getattr(text_config, "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
