"""The serving benchmark's requests: random token ids, a ShareGPT-format file, or a file of prompts.

* ``random``: prompts of random token ids of fixed lengths, or uniform in ``[L(1 - r), L(1 + r)]``.
  With a tokenizer (``--tokenizer``, or the model directory), ids are drawn from the vocabulary less
  its special tokens (a random BOS or end-of-turn token would change what the model does); without
  one, from ``--token-range``. The chat endpoint takes the ids' decoded text.
* ``sharegpt``: a JSON list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
  "value": ...}, ...]}``; each conversation's first turn is the prompt and the reply's token count
  (with a tokenizer; else ``--output-len``) the output length.
* ``prompts``: a file of prompts, one per line (plain text), a JSON list of strings, or JSON lines
  ``{"prompt": str, "output_len": int (optional)}``.

A given ``--dataset-path`` picks ``sharegpt`` or ``prompts`` from its content unless
``--dataset-name`` says which.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "sharegpt", "prompts")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (sent as they are to /v1/completions)
    output_len: int


def load_tokenizer(name: str | None):
    """The tokenizer of a checkpoint folder, a model id or a ``.gguf`` file (its metadata's)."""
    if name is None:
        return None
    from transformers import AutoTokenizer

    path = Path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    return AutoTokenizer.from_pretrained(name, trust_remote_code=False)


def sample_lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    if ratio == 0:
        return [mean] * n
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def ordinary_token_ids(tokenizer) -> list[int]:
    """The vocabulary's ids less the special ones (BOS, EOS, chat markers and other added specials)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    return [i for i in range(len(tokenizer)) if i not in special]


def random_requests(args, rng: random.Random, tokenizer, text: bool) -> list[BenchRequest]:
    inputs = sample_lengths(args.num_prompts, args.input_len, args.range_ratio, rng)
    outputs = sample_lengths(args.num_prompts, args.output_len, args.range_ratio, rng)
    if tokenizer is not None:
        pool = ordinary_token_ids(tokenizer)
        draw = lambda: rng.choice(pool)
    else:
        if text:
            raise SystemExit("random prompts for the chat endpoint need a tokenizer for their text: --tokenizer")
        low, high = args.token_range
        draw = lambda: rng.randrange(low, high)
    out = []
    for n, m in zip(inputs, outputs):
        ids = [draw() for _ in range(n)]
        out.append(BenchRequest(tokenizer.decode(ids) if text else ids, m))
    return out


def sharegpt_requests(path: Path, args, rng: random.Random, tokenizer) -> list[BenchRequest]:
    data = json.loads(path.read_text())
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not turns or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        if prompt and reply:
            pairs.append((prompt, reply))
    if not pairs:
        raise SystemExit(f"expected ShareGPT conversations of at least two turns in {path}, got none")
    out = []
    for prompt, reply in take(pairs, args.num_prompts, rng, path):
        output_len = args.output_len if tokenizer is None or args.fixed_output_len else len(tokenizer(reply).input_ids)
        out.append(BenchRequest(prompt, max(1, output_len)))
    return out


def prompt_file_requests(path: Path, args, rng: random.Random) -> list[BenchRequest]:
    text = path.read_text()
    records: list[tuple[str, int | None]] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = [(p, None) for p in json.loads(text)]
    elif stripped.startswith("{"):
        for line in text.splitlines():
            if line.strip():
                record = json.loads(line)
                records.append((record["prompt"], record.get("output_len")))
    else:
        records = [(line, None) for line in text.splitlines() if line.strip()]
    if not records or not all(isinstance(p, str) and p for p, _ in records):
        raise SystemExit(f"expected non-empty prompts in {path} (lines, a JSON list or JSON lines), got none")
    return [BenchRequest(p, n or args.output_len) for p, n in take(records, args.num_prompts, rng, path)]


def take(records: list, count: int, rng: random.Random, path: Path) -> list:
    """``count`` records in a random order; a file with fewer is gone through again (each pass shuffled),
    and the output says so."""
    out = []
    while len(out) < count:
        block = list(records)
        rng.shuffle(block)
        out += block[: count - len(out)]
    if count > len(records):
        print(f"{path}: its {len(records)} prompts repeated to make {count} requests", file=sys.stderr)
    return out


def dataset_name(path: Path) -> str:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "prompts"
    is_sharegpt = isinstance(data, list) and data and isinstance(data[0], dict) and "conversations" in data[0]
    return "sharegpt" if is_sharegpt else "prompts"


def load_requests(args, rng: random.Random, tokenizer, text: bool) -> tuple[str, list[BenchRequest]]:
    """``(dataset name, requests)`` for the command line's dataset; ``text``: the endpoint takes text."""
    path = Path(args.dataset_path) if args.dataset_path else None
    name = args.dataset_name or (dataset_name(path) if path is not None else "random")
    if name != "random" and path is None:
        raise SystemExit(f"--dataset-name {name} needs --dataset-path FILE")
    if name == "random":
        return name, random_requests(args, rng, tokenizer, text)
    if name == "sharegpt":
        return name, sharegpt_requests(path, args, rng, tokenizer)
    return name, prompt_file_requests(path, args, rng)
