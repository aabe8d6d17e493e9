"""The sampling defaults a checkpoint recommends, from its ``generation_config.json`` (as vLLM reads them)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..models.loader import read_json
from .sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams

logger = logging.getLogger("portattn")

FILE = "generation_config.json"
CHOICES = ("auto", "vllm")  # besides a folder path


def sampling_defaults(generation_config: str, model: str) -> dict[str, float | int]:
    """The values that requests which do not set them take, for engine option ``generation_config``:

    * ``"auto"``: those the checkpoint folder ``model``'s ``generation_config.json`` sets (none when
      it has no such file);
    * ``"vllm"``: none (vLLM's defaults, :class:`SamplingParams`' own);
    * a folder path: those of the ``generation_config.json`` in it (refused if it has none).

    Read are the fields of :data:`GENERATION_CONFIG_FIELDS` (temperature, top_p, top_k, min_p,
    repetition_penalty) that the file sets to a value other than null; ``top_k`` 0 (transformers'
    "no limit") becomes -1. ``do_sample`` is not read (vLLM does not either). Values that
    :class:`SamplingParams` refuses raise ``ValueError`` naming the file. Logs what it applies.
    """
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        file = Path(model) / FILE
        if not file.is_file():
            return {}
    else:
        file = Path(generation_config) / FILE
        if not file.is_file():
            raise ValueError(
                f"expected generation_config to be 'auto', 'vllm' or a folder holding {FILE}, "
                f"got {generation_config!r} (no {file})"
            )
    data = read_json(file)
    values = {name: data[name] for name in GENERATION_CONFIG_FIELDS if data.get(name) is not None}
    if values.get("top_k") == 0:
        values["top_k"] = -1
    try:
        SamplingParams(**values)
    except ValueError as err:
        raise ValueError(f"expected sampling values that SamplingParams accepts in {file}: {err}") from None
    if values:
        shown = ", ".join(f"{name}={value}" for name, value in values.items())
        logger.warning(
            "sampling defaults from %s: %s (requests that set these keep their values; "
            "generation_config='vllm', --generation-config vllm, uses vLLM's defaults instead)",
            file,
            shown,
        )
    return values
