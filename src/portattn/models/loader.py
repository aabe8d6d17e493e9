"""Hugging Face checkpoint directories -> our model classes (weights through each parameter's
``weight_loader``), tokenizer and stop tokens.

Checkpoint tensors reach the ``weight_loader`` hooks as :class:`~portattn.models.layers.CheckpointSlice`
handles (safetensors ``get_slice``): a sharded parameter narrows the handle to its rank's part and only
that part is read from the file, so under tensor parallelism no rank reads a sharded tensor whole.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..distributed.group import TPGroup, tp_or_single
from . import model_class
from .base import KV_SCALE_KEY, MultimodalModel
from .layers import CheckpointSlice, WeightShapeError, default_weight_loader

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


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created inside get ``dtype`` (those that ask for another keep theirs)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_weights(
    module: nn.Module,
    files: list[Path],
    checkpoint_name: Callable[[str], tuple[str, object] | None],
    *,
    what: str,
    tied: frozenset[str] = frozenset(),
) -> None:
    """Fill ``module``'s parameters from safetensors ``files`` through each parameter's ``weight_loader``.

    ``checkpoint_name(key)`` maps a checkpoint tensor to ``(parameter name, shard)`` (``shard`` None:
    the whole parameter) or ``None`` (not used). The parameter's ``weight_loader(param, loaded)`` (or
    ``(param, loaded, shard)``) copies what it owns, converting dtype on the device; ``loaded`` is a
    :class:`~portattn.models.layers.CheckpointSlice` of the file's tensor, read only where (and as
    far as) the hook reads it. Every parameter (every shard of a merged one) must be loaded, except
    ``tied`` ones.
    """

    def lazy(f, key: str) -> CheckpointSlice:
        part = f.get_slice(key)
        return CheckpointSlice(part, part.get_shape())

    def tensors():
        for file in tqdm(files, desc="loading weights", unit="shard", leave=False, disable=len(files) < 2):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield key, functools.partial(lazy, f, key)

    _load(module, tensors(), checkpoint_name, what=what, tied=tied)


def load_state(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    checkpoint_name: Callable[[str], tuple[str, object] | None],
    *,
    what: str,
    tied: frozenset[str] = frozenset(),
) -> None:
    """:func:`load_weights` from tensors in memory, keyed by checkpoint names."""

    def lazy(key: str) -> CheckpointSlice:
        return CheckpointSlice(state[key], state[key].shape)

    _load(
        module,
        ((key, functools.partial(lazy, key)) for key in state),
        checkpoint_name,
        what=what,
        tied=tied,
    )


def _load(module, tensors, checkpoint_name, *, what: str, tied: frozenset[str]) -> None:
    params = dict(module.named_parameters())
    loaded: set[tuple[str, object]] = set()
    for key, get_tensor in tensors:
        target = checkpoint_name(key)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise ValueError(f"expected checkpoint tensors of {what}, got unknown tensor {key!r}")
        param = params[name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, get_tensor())
            else:
                loader(param, get_tensor(), shard)
        except WeightShapeError as err:
            raise ValueError(f"expected {key} of shape {err.want}, got {err.got}") from None
        loaded.add((name, shard))
    expected = {
        (name, shard)
        for name, param in params.items()
        if name not in tied
        for shard in (getattr(param, "shards", None) or (None,))
    }
    missing = sorted(name if shard is None else f"{name} (shard {shard!r})" for name, shard in expected - loaded)
    if missing:
        raise ValueError(f"expected every weight of {what} in the checkpoint, missing {missing[:5]}")


def supports_tensor_parallel(cls: type) -> bool:
    """A class that declares ``supports_tensor_parallel`` and whose constructor takes ``tp`` (a subclass
    that overrides ``__init__`` without it does not inherit the support)."""
    return bool(getattr(cls, "supports_tensor_parallel", False)) and "tp" in inspect.signature(cls).parameters


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    config=None,
    mm_attention_backend: str = "auto",
    tp: TPGroup | None = None,
) -> torch.nn.Module:
    """Build the model for ``config.architectures`` on ``device`` in ``dtype`` and load its safetensors
    weights (sharded or not) through the parameters' ``weight_loader`` hooks.

    A multimodal class (:class:`~portattn.models.base.MultimodalModel`) also gets ``dtype``, ``device``
    and ``mm_attention_backend``, to select its encoders' attention backend once, at construction.
    ``tp`` (a tensor-parallel group of more than one rank) builds this rank's shard of the model,
    for a class that declares ``supports_tensor_parallel``; its parameters read only their slices.
    """
    path = _checkpoint_dir(path)
    config = config if config is not None else load_config(path)
    cls = model_class(getattr(config, "architectures", None))
    tp = tp_or_single(tp)
    options = {}
    if supports_tensor_parallel(cls):
        options["tp"] = tp
    elif tp.size > 1:
        raise ValueError(
            f"expected a model class that supports tensor parallelism for tensor_parallel_size {tp.size}, "
            f"got {cls.__name__}"
        )
    if issubclass(cls, MultimodalModel):
        options |= dict(dtype=dtype, device=device, mm_attention_backend=mm_attention_backend)
    with torch.device(device), default_dtype(dtype):
        model = cls(config, **options)
    load_weights(model, safetensors_files(path), model.checkpoint_name, what=cls.__name__, tied=model.tied_parameters())
    model.tie_weights()
    model.to(device)  # the rotary buffers, built on the CPU
    model.eval().requires_grad_(False)
    shard = f", rank {tp.rank} of {tp.size}" if tp.size > 1 else ""
    logger.info("loaded %s from %s (%s, %s%s)", cls.__name__, path, dtype, device, shard)
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


def kv_cache_scales(path: str | Path, num_layers: int) -> list[tuple[float, float]]:
    """Per-layer ``(k_scale, v_scale)`` of an fp8 KV cache, from the checkpoint where it has them.

    Read from the tensors ``...layers.{i}.self_attn.k_scale`` and ``v_scale`` (``kv_scale`` sets
    both; ``self_attn.attn.`` prefixes too), one number each; a layer without them gets 1.0. An MLA
    latent cache uses the K scale.
    """
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for file in safetensors_files(_checkpoint_dir(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                match = KV_SCALE_KEY.search(key)
                if match is None or int(match.group(1)) >= num_layers:
                    continue
                value = f.get_tensor(key)
                if value.numel() != 1 or not torch.isfinite(value).all() or float(value.reshape(-1)[0]) <= 0:
                    raise ValueError(f"expected {key} to hold one positive finite scale, got {value.tolist()}")
                layer, which = int(match.group(1)), match.group(2)
                scale = float(value.reshape(-1)[0])
                if which in ("k_scale", "kv_scale"):
                    scales[layer][0] = scale
                if which in ("v_scale", "kv_scale"):
                    scales[layer][1] = scale
    found = sum(pair != [1.0, 1.0] for pair in scales)
    logger.info("KV cache scales: %d of %d layers other than 1.0 in the checkpoint", found, num_layers)
    return [tuple(pair) for pair in scales]
