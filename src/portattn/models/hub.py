"""Where a checkpoint is: a local directory, or a Hugging Face model id already in the local Hugging
Face cache (nothing is downloaded), and the dtype its config names.

``LLM("meta-llama/Llama-3.1-8B-Instruct")`` finds the snapshot that ``hf download`` (or
``huggingface-cli download``) left in the cache (``$HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``) through huggingface_hub's offline lookup, and says how to fetch it
when it is not there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

# org/name as the Hub spells ids: letters, digits, '-', '_', '.'; neither part starts with '.'.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")

# The dtypes a checkpoint's config may name (``dtype``, or ``torch_dtype`` before transformers 5).
_CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` that is not a path on this machine (a relative directory of that name wins) nor a
    ``.gguf`` file name."""
    return bool(_REPO_ID.match(name)) and not name.endswith(".gguf") and not os.path.exists(name)


def resolve_checkpoint(model: str, *, cache_dir: str | os.PathLike | None = None) -> str:
    """``model`` itself when it is a path here (or not a model id); for a Hugging Face id
    (``org/name``) not on disk, the directory of its snapshot in the local Hugging Face cache.

    An id missing from the cache raises ``ValueError`` with the command that downloads it.
    ``cache_dir``: the cache to look in (default: huggingface_hub's, ``$HF_HUB_CACHE``).
    """
    if not looks_like_repo_id(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(model, local_files_only=True, cache_dir=cache_dir)
    except LocalEntryNotFoundError:
        raise ValueError(
            f"expected a checkpoint directory or a Hugging Face model id in the local Hugging Face cache, got "
            f"{model!r}, which is neither (portattn never downloads): fetch it with `hf download {model}` "
            f"(or `huggingface-cli download {model}`; gated models need `hf auth login` first), or pass a directory"
        ) from None
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"expected config.json in the cached snapshot of {model!r} at {path}, got a partial download: "
            f"complete it with `hf download {model}`"
        )
    return path


def checkpoint_dtype(model: str) -> torch.dtype | None:
    """The dtype ``config.json`` in directory ``model`` names (``dtype`` or ``torch_dtype``, at the top
    level or in ``text_config``); ``None`` when it names none or there is no readable config."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("dtype", "torch_dtype"):
            name = source.get(key)
            if isinstance(name, str) and name.removeprefix("torch.") in _CONFIG_DTYPES:
                return _CONFIG_DTYPES[name.removeprefix("torch.")]
    return None
