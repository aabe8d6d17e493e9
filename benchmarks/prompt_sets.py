"""The real-text prompt sets of ``benchmarks/prompts/`` (one ``{"kind", "prompt"}`` object a line), as
texts or as chat-template token ids."""

from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).parent / "prompts"
SETS = ("repetitive", "chat")


def read(name: str) -> list[str]:
    """The prompts of ``prompts/<name>.jsonl``."""
    return [json.loads(line)["prompt"] for line in (FOLDER / f"{name}.jsonl").read_text().splitlines() if line]


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as one user message through the tokenizer's chat template, ready to generate."""
    template = tokenizer.apply_chat_template
    return [
        list(template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=True)["input_ids"])
        for t in texts
    ]
