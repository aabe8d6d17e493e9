"""Hugging Face checkpoint directories -> our model classes (weights through each parameter's
``weight_loader``), tokenizer and stop tokens.

Checkpoint tensors reach the ``weight_loader`` hooks as :class:`~portattn.models.layers.CheckpointSlice`
handles (safetensors ``get_slice``): a sharded parameter narrows the handle to its rank's part and only
that part is read from the file, so under tensor parallelism no rank reads a sharded tensor whole.

A checkpoint is data, never code: every transformers load passes ``trust_remote_code=False``, and a
file whose ``auto_map`` points at Python shipped with the checkpoint is refused before transformers
reads it (unless ``config.json`` also names a ``model_type`` transformers has, which it then loads
without that code). Shard names from ``model.safetensors.index.json`` must stay inside the
checkpoint directory. A file that cannot be read is reported as a ``ValueError`` naming it.

A path ending in ``.gguf`` is one llama.cpp file (config, tokenizer and weights): :mod:`.gguf` reads it,
and its tensors reach the same ``weight_loader`` hooks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path, PurePath

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ..distributed.group import TPGroup, tp_or_single
from ..errors import expect, is_int
from ..quantization import check_quantization
from . import gguf, model_class
from .base import KV_SCALE_KEY, MultimodalModel
from .layers import CheckpointSlice, WeightShapeError, default_weight_loader
from .layers.fp8_weights import FP8Weights, dequantizing_slice
from .layers.linear import quantize_linears

logger = logging.getLogger("portattn")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Sizes a model divides by or allocates from; a checkpoint with one below 1 is refused at load.
_POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"expected a Hugging Face checkpoint directory with config.json or a .gguf file, got {str(path)!r}"
        )
    return path


def read_json(file: Path) -> dict:
    """A JSON object file, or a ``ValueError`` naming the file."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"expected a JSON object in {file}, got {type(exc).__name__}: {exc}") from exc
    expect(isinstance(data, dict), f"a JSON object in {file}", type(data).__name__)
    return data


def _first_line(exc: BaseException) -> str:
    """``Type: message`` on one line (whitespace runs, newlines included, become one space)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def refuse_remote_code(path: Path, name: str, native: bool = False) -> None:
    """Refuse ``path / name`` if its ``auto_map`` names code of the checkpoint that a load would need.

    ``native``: the file's type is one transformers has, so the map is ignored (and the loads,
    with ``trust_remote_code=False``, never import it).
    """
    file = path / name
    if native or not file.is_file():
        return
    auto_map = read_json(file).get("auto_map")
    expect(
        not auto_map,
        f"a checkpoint that transformers loads without code of its own (portattn never runs code from "
        f"a checkpoint) in {path}",
        f"auto_map {auto_map} in {name}",
    )


def _native_config(path: Path) -> bool:
    from transformers import CONFIG_MAPPING  # transformers is imported where it is used: its import is slow

    return read_json(path / "config.json").get("model_type") in CONFIG_MAPPING


def load_config(path: str | Path):
    """``config.json`` (or a GGUF file's metadata) through ``AutoConfig`` (no checkpoint code), its sizes checked."""
    if gguf.is_gguf(path):
        config, source = gguf.load_config(path), Path(path)
    else:
        path = _checkpoint_dir(path)
        refuse_remote_code(path, "config.json", native=_native_config(path))
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except Exception as exc:  # transformers raises OSError, ValueError, TypeError, hub validation errors
            raise ValueError(
                f"expected a config.json that transformers can read in {path}, got {_first_line(exc)}"
            ) from exc
        source = path / "config.json"
    text_config = getattr(config, "text_config", None) or config
    for name in _POSITIVE_SIZES:
        value = getattr(text_config, name, None)
        if value is not None:
            expect(is_int(value) and value >= 1, f"{name} in {source} to be a positive int", value)
    return config


def _shard(path: Path, index: Path, name: object) -> Path:
    """A shard named by the index, confined to the checkpoint directory (the name is checked, not
    resolved: hub snapshots link their files to blobs elsewhere)."""
    parts = PurePath(name).parts if isinstance(name, str) and name else ()
    expect(
        bool(parts) and not PurePath(name).is_absolute() and ".." not in parts,
        f"shard names inside the checkpoint directory in {index}",
        repr(name),
    )
    return path / name


def check_safetensors(file: Path) -> None:
    """A readable safetensors file whose header covers the file, or a ``ValueError`` naming it."""
    expect(file.is_file(), "an existing safetensors file", str(file))
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            f.keys()
    except Exception as exc:  # SafetensorError (header too small, too large, truncated), OSError
        raise ValueError(f"expected a safetensors file at {file}, got {_first_line(exc)}") from exc


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files (the index's shards, or every ``*.safetensors``), each checked."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        expect(
            isinstance(weight_map, dict) and weight_map,
            f"a non-empty 'weight_map' object in {index}",
            type(weight_map).__name__ if weight_map is not None else "none",
        )
        files = [_shard(path, index, name) for name in sorted(set(map(str, weight_map.values())))]
        missing = next((file for file in files if not file.is_file()), None)
        expect(missing is None, f"every shard named in {index}", f"no file {missing}")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"expected *.safetensors files in {str(path)!r}, got none")
    for file in files:
        check_safetensors(file)
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
    fp8: FP8Weights | None = None,
) -> None:
    """Fill ``module``'s parameters from safetensors ``files`` through each parameter's ``weight_loader``.

    ``checkpoint_name(key)`` maps a checkpoint tensor to ``(parameter name, shard)`` (``shard`` None:
    the whole parameter) or ``None`` (not used). The parameter's ``weight_loader(param, loaded)`` (or
    ``(param, loaded, shard)``) copies what it owns, converting dtype on the device; ``loaded`` is a
    :class:`~portattn.models.layers.CheckpointSlice` of the file's tensor, read only where (and as
    far as) the hook reads it. Every parameter (every shard of a merged one) must be loaded, except
    ``tied`` ones. ``fp8``: the checkpoint's fp8 weights arrive dequantized (float32), their scales
    consumed with them (:mod:`~portattn.models.layers.fp8_weights`).
    """

    scales: dict[str, Path] = {}  # fp8 checkpoints: scale tensor -> its file
    if fp8 is not None:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                scales |= {key: file for key in f.keys() if fp8.is_side_tensor(key)}  # noqa: SIM118

    def lazy(f, key: str) -> CheckpointSlice:
        part = f.get_slice(key)
        scale_key = fp8.scale_key(key) if fp8 is not None else None
        if scale_key in scales:  # a quantized weight: dequantized as it is read
            with safe_open(str(scales[scale_key]), framework="pt", device="cpu") as g:
                scale = g.get_tensor(scale_key)
            return dequantizing_slice(part, key, lambda: scale, scale.shape, fp8)
        return CheckpointSlice(part, part.get_shape())

    def tensors():
        for file in tqdm(files, desc="loading weights", unit="shard", leave=False, disable=len(files) < 2):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key not in scales:  # scales go with their weights
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


def fp8_weights_of(config, cls: type) -> FP8Weights | None:
    """How the checkpoint's fp8 weights are scaled (``quant_method == "fp8"``, dequantized at load), or
    None for an unquantized checkpoint or a method the model class loads itself (``cls.quant_methods``:
    gpt-oss's MXFP4); any other method is refused."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    own = tuple(getattr(cls, "quant_methods", ()))
    if method in own:
        return None
    supported = ["fp8", *own]
    expect(method == "fp8", f"an unquantized checkpoint or quant_method in {supported} for {cls.__name__}", method)
    return FP8Weights.from_config(quant)


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
    quantization: str | None = None,
) -> torch.nn.Module:
    """Build the model for ``config.architectures`` on ``device`` in ``dtype`` and load its safetensors
    weights (sharded or not), or a GGUF file's, through the parameters' ``weight_loader`` hooks.

    A multimodal class (:class:`~portattn.models.base.MultimodalModel`) also gets ``dtype``, ``device``
    and ``mm_attention_backend``, to select its encoders' attention backend once, at construction.
    ``tp`` (a tensor-parallel group of more than one rank) builds this rank's shard of the model,
    for a class that declares ``supports_tensor_parallel``; its parameters read only their slices.
    ``quantization="fp8"`` quantizes the decoder's linear layers once loaded (:mod:`.layers.fp8_linear`).
    """
    check_quantization(quantization, dtype, device)
    path = Path(path) if gguf.is_gguf(path) else _checkpoint_dir(path)
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
    if gguf.is_gguf(path):
        tensors = gguf.checkpoint_tensors(path, config)
        _load(model, tensors, model.checkpoint_name, what=cls.__name__, tied=model.tied_parameters())
    else:
        fp8 = fp8_weights_of(config, cls)
        files = safetensors_files(path)
        load_weights(model, files, model.checkpoint_name, what=cls.__name__, tied=model.tied_parameters(), fp8=fp8)
    model.tie_weights()
    model.to(device)  # the rotary buffers, built on the CPU
    model.eval().requires_grad_(False)
    shard = f", rank {tp.rank} of {tp.size}" if tp.size > 1 else ""
    if quantization is not None:
        count = quantize_linears(model, quantization)
        shard += f", {count} linear layers in {quantization}"
    logger.info("loaded %s from %s (%s, %s%s)", cls.__name__, path, dtype, device, shard)
    return model


def load_tokenizer(path: str | Path):
    """The directory's (or GGUF file's) tokenizer through ``AutoTokenizer`` (no checkpoint code), or ``None``
    when it has none."""
    if gguf.is_gguf(path):
        return gguf.load_tokenizer(path)
    path = Path(path)
    files = [name for name in _TOKENIZER_FILES if (path / name).is_file()]
    if not files:
        return None
    refuse_remote_code(path, "tokenizer_config.json")
    # Imported here: transformers 5.17's AutoTokenizer brings its generation utilities (torch._dynamo,
    # scikit-learn where installed), which kept `import portattn.engine.llm` at 8 s after torch on an H200
    # machine (now 2 s). Its model configurations import the same modules when a checkpoint's config
    # loads (benchmarks/results/engine_h200/round11/NOTES.md).
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:  # tokenizers' parse errors, JSONDecodeError, OSError ...
        raise ValueError(
            f"expected a tokenizer that transformers can load from {', '.join(files)} in {path}, got {_first_line(exc)}"
        ) from exc


def load_image_processor(path: str | Path):
    """The checkpoint's image processor through ``AutoImageProcessor`` (no checkpoint code)."""
    path = Path(path)
    expect(
        (path / "preprocessor_config.json").is_file(),
        "preprocessor_config.json in the checkpoint directory to process raw images "
        "(or 'pixel_values' and 'image_grid_thw' in multi_modal_data)",
        "none",
    )
    refuse_remote_code(path, "preprocessor_config.json")
    refuse_remote_code(path, "processor_config.json")
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise ValueError(
            f"expected an image processor that transformers can load from {path / 'preprocessor_config.json'}, "
            f"got {_first_line(exc)}"
        ) from exc


def eos_token_ids(path: str | Path, config) -> set[int]:
    """End-of-sequence ids from ``generation_config.json`` if present, else from the model config (a GGUF
    file: its end-of-sequence, end-of-turn and end-of-message tokens)."""
    if gguf.is_gguf(path):
        return gguf.eos_token_ids(path)
    eos = None
    file = Path(path) / "generation_config.json"
    if file.is_file():
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(path, trust_remote_code=False).eos_token_id
        except Exception as exc:
            raise ValueError(
                f"expected a generation config that transformers can read in {file}, got {_first_line(exc)}"
            ) from exc
        source = file
    if eos is None:
        text_config = getattr(config, "text_config", None) or config
        eos = getattr(text_config, "eos_token_id", None)
        source = Path(path) / "config.json"
    if eos is None:
        return set()
    ids = [eos] if not isinstance(eos, (list, tuple)) else list(eos)
    expect(all(is_int(t) and t >= 0 for t in ids), f"eos_token_id of non-negative ints in {source}", eos)
    return set(ids)


def kv_cache_scales(path: str | Path, num_layers: int) -> list[tuple[float, float]]:
    """Per-layer ``(k_scale, v_scale)`` of an fp8 KV cache, from the checkpoint where it has them.

    Read from the tensors ``...layers.{i}.self_attn.k_scale`` and ``v_scale`` (``kv_scale`` sets
    both; ``self_attn.attn.`` prefixes too), one number each; a layer without them gets 1.0. An MLA
    latent cache uses the K scale.
    """
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    files = [] if gguf.is_gguf(path) else safetensors_files(_checkpoint_dir(path))  # GGUF files carry none
    for file in files:
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
