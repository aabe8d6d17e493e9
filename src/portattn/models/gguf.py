"""GGUF files (llama.cpp's checkpoint format): the config, tokenizer and weights of one ``.gguf`` file.

The metadata becomes a transformers config and tokenizer through transformers' own GGUF support
(``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file=``), so a file means here what it means there.
The weights are read with the ``gguf`` package and reach each parameter's ``weight_loader`` as
:class:`GGUFSlice` handles: a tensor-parallel rank narrows a handle to its rows or columns and only
those are read from the file and dequantized (float32, then the model's dtype as they are copied).

Two layouts differ from a Hugging Face checkpoint, and are undone as transformers undoes them:

* llama.cpp stores the rows of each head of a Llama-architecture Q and K projection interleaved for
  its rotary layout (``_rotary_rows``);
* it stores Gemma's ``(1 + w)`` RMSNorm weights with the 1 added (read back as ``w``).

Files, configs, tokenizers and tensor-name maps are cached per file (path, size and modification time),
so that a second engine over the same file does not parse its metadata again.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import expect
from .layers import CheckpointSlice

logger = logging.getLogger("portattn")

# GGUF ``general.architecture`` values whose tensors map onto a registered family. Mistral's files carry
# "llama" (transformers reads them as Mistral only when ``general.name`` is exactly "mistral").
SUPPORTED_ARCHITECTURES = ("gemma2", "gemma3", "llama", "qwen2", "qwen3")
# The config transformers builds from the metadata (its model_type) -> our architecture name.
_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Tensor types dequantized at load (by gguf.quants.dequantize); others are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_GEMMA = ("gemma2", "gemma3")

_INSTALL = "loading .gguf files needs the gguf package: pip install gguf"


def is_gguf(path) -> bool:
    """A path naming a ``.gguf`` file (checked to exist when it is opened)."""
    return str(path).lower().endswith(".gguf")


def _gguf():
    try:
        import gguf
    except ImportError as err:
        raise ImportError(_INSTALL) from err
    return gguf


def _key(path) -> tuple[str, int, int]:
    """The cache key of a file: its resolved path, size and modification time."""
    path = Path(path)
    expect(path.is_file(), "an existing .gguf file", str(path))
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _reader(key: tuple[str, int, int]):
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(key[0])
    except Exception as exc:  # bad magic, truncated header, unknown tensor type ...
        text = " ".join(str(exc).split())[:300]
        raise ValueError(f"expected a GGUF file at {key[0]}, got {type(exc).__name__}: {text}") from exc
    _check(reader, key[0])
    return reader


def _field(reader, name: str, default=None):
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def _check(reader, path: str) -> None:
    """Refuse what this loader would read wrongly: another architecture, another tensor type, tensors of
    more than two dims (stacked experts), llama.cpp's rotary frequency factors."""
    arch = _field(reader, "general.architecture")
    expect(
        arch in SUPPORTED_ARCHITECTURES,
        f"a GGUF architecture in {list(SUPPORTED_ARCHITECTURES)}",
        f"{arch!r} in {path}",
    )
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        expect(kind in SUPPORTED_TYPES, f"GGUF tensor types in {list(SUPPORTED_TYPES)}", f"{kind} in {tensor.name}")
        expect(len(tensor.shape) <= 2, "GGUF tensors of one or two dims", f"{len(tensor.shape)} in {tensor.name}")
    # Llama 3.1+ files store their rope scaling as per-dimension factors that no config field carries
    # (transformers' GGUF loading ignores them, so its model of such a file is not the trained one either).
    names = {tensor.name for tensor in reader.tensors}
    expect(
        "rope_freqs.weight" not in names,
        "a file without rope_freqs.weight (llama.cpp's rope scaling factors, which no config field carries)",
        f"rope_freqs.weight in {path}",
    )


def open_gguf(path):
    """The file's ``gguf.GGUFReader``, its architecture and tensor types checked (cached per file)."""
    return _reader(_key(path))


@functools.lru_cache(maxsize=2)
def _config(key: tuple[str, int, int]):
    from transformers import AutoConfig

    _reader(key)  # checked first: transformers' own error for another architecture names no alternative
    path = Path(key[0])
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise ValueError(f"expected GGUF metadata that transformers can read in {path}, got {text}") from exc
    expect(config.model_type in _MODEL_CLASSES, f"a model_type in {list(_MODEL_CLASSES)}", repr(config.model_type))
    config.architectures = [_MODEL_CLASSES[config.model_type]]
    return config


def load_config(path):
    """The transformers config of a GGUF file's metadata, ``architectures`` naming our model class."""
    return copy.deepcopy(_config(_key(path)))


@functools.lru_cache(maxsize=2)
def _tokenizer(key: tuple[str, int, int]):
    from transformers import AutoTokenizer

    path = Path(key[0])
    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise ValueError(f"expected a tokenizer that transformers can build from {path}, got {text}") from exc


def load_tokenizer(path):
    """The tokenizer in the file's metadata (chat template and special tokens included), or ``None``
    for a file without one (``tokenizer.ggml.model`` absent)."""
    key = _key(path)
    if _field(_reader(key), "tokenizer.ggml.model") is None:
        return None
    return copy.deepcopy(_tokenizer(key))


def eos_token_ids(path) -> set[int]:
    """The file's end-of-generation tokens: end of sequence, end of turn and end of message, as
    llama.cpp stops on them."""
    reader = open_gguf(path)
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {int(value) for value in (_field(reader, key) for key in keys) if value is not None}


@functools.lru_cache(maxsize=2)
def _tensor_names(key: tuple[str, int, int]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face checkpoint name, from gguf's name table over the names of
    transformers' model of the same config (built on the meta device: names only)."""
    from transformers import AutoModelForCausalLM

    gguf = _gguf()
    config = _config(key)
    arch = _field(_reader(key), "general.architecture")
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {}
    for name in model.state_dict():
        stem, _, suffix = name.rpartition(".")
        gguf_stem = table.get_name(stem)
        if gguf_stem is not None:
            names[f"{gguf_stem}.{suffix}"] = name
    return names


def _rotary_rows(rows: int, heads: int) -> np.ndarray:
    """For each row of a Hugging Face Q or K projection (``heads`` heads), its row in llama.cpp's file.

    llama.cpp interleaves each head's two rotary halves: Hugging Face row ``h*d + j*d/2 + i`` (half ``j``,
    pair ``i``) is stored as row ``h*d + 2*i + j``, ``d = rows / heads``.
    """
    expect(rows % (2 * heads) == 0, f"Q/K rows divisible by 2 x {heads} heads", rows)
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


class GGUFSlice(CheckpointSlice):
    """A GGUF tensor (or a part of one) in PyTorch's dim order, not read yet; :meth:`read` returns
    float32 values.

    ``rows`` are the file's rows that make up dim 0, in order (any subset, any order: each row of a
    quantized tensor is a whole number of quant blocks, so rows are read independently); ``cols`` is
    the range of the last dim. Quant blocks run along the last dim, so a column range reads the
    blocks it touches (a range that does not start or end on a block boundary reads the one partial
    block at that end whole and cuts it after dequantizing): every split a rank makes is possible.
    ``offset`` is added to every value (Gemma's norms).
    """

    def __init__(self, tensor, shape, rows: np.ndarray, cols: slice, offset: float = 0.0):
        super().__init__(tensor, shape)
        self.tensor, self.rows, self.cols, self.offset = tensor, rows, cols, offset

    def narrow(self, dim: int, start: int, length: int) -> GGUFSlice:
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            size = self.shape[dim]
            raise ValueError(f"expected a range within dim {dim} of size {size}, got [{start}, {start + length})")
        shape = (*self.shape[:dim], length, *self.shape[dim + 1 :])
        if dim == 0:
            return GGUFSlice(self.tensor, shape, self.rows[start : start + length], self.cols, self.offset)
        first = self.cols.start + start
        return GGUFSlice(self.tensor, shape, self.rows, slice(first, first + length), self.offset)

    def read(self) -> torch.Tensor:
        gguf = _gguf()
        kind, data = self.tensor.tensor_type, self.tensor.data  # data: [rows, elements or bytes of a row]
        if data.ndim == 1:  # norms and biases: small, decoded whole
            values = gguf.quants.dequantize(np.asarray(data), kind)[self.rows]
        else:
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            per_block = block_bytes if data.dtype == np.uint8 else 1  # F32 / F16 rows hold elements
            first, last = self.cols.start // block, -(-self.cols.stop // block)
            raw = data[self.rows, first * per_block : last * per_block]  # reads these rows' blocks only
            start = self.cols.start - first * block
            values = gguf.quants.dequantize(raw, kind)[:, start : start + self.cols.stop - self.cols.start]
        out = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file's map is read-only
        return out + self.offset if self.offset else out


def _whole(tensor, config, arch: str) -> GGUFSlice:
    shape = tuple(reversed([int(n) for n in tensor.shape]))  # GGUF lists the innermost dim first
    rows = np.arange(shape[0])
    if arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
        rows = _rotary_rows(shape[0], heads)
    offset = -1.0 if arch in _GEMMA and tensor.name.endswith("norm.weight") else 0.0
    return GGUFSlice(tensor, shape, rows, slice(0, shape[-1]), offset)


def checkpoint_tensors(path, config) -> Iterator[tuple[str, Callable[[], GGUFSlice]]]:
    """``(Hugging Face checkpoint name, handle maker)`` for each tensor of the file, as the loader's
    weight walk takes them; a tensor with no Hugging Face name is refused."""
    key = _key(path)
    reader, names = _reader(key), _tensor_names(key)
    arch = _field(reader, "general.architecture")
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        expect(name is not None, f"GGUF tensors that {arch} models have in {path}", repr(tensor.name))
        yield name, functools.partial(_whole, tensor, config, arch)
