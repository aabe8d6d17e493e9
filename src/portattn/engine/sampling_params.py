"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .arguments import doc


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature = 0`` is greedy (``top_p`` / ``top_k`` / ``seed`` are then unused). ``top_k = -1``
    keeps every token; ``top_p = 1`` disables nucleus filtering. ``seed`` gives the request its own
    ``torch.Generator``, so its samples do not depend on the rest of the batch. Generation stops
    after ``max_tokens`` tokens, or at an end-of-sequence token (kept in the output) unless
    ``ignore_eos``. ``return_logits`` keeps the logits each output token was sampled from
    (``[num_output_tokens, vocab]``); ``return_prompt_logits`` keeps the logits at every prompt
    position (``[num_prompt_tokens, vocab]``) and makes the request skip the prefix cache.
    """

    max_tokens: int = field(default=16, metadata=doc("most tokens generated per prompt"))
    temperature: float = field(default=0.0, metadata=doc("softmax temperature; 0 is greedy"))
    top_p: float = field(
        default=1.0, metadata=doc("nucleus sampling: the smallest set of tokens with this much probability")
    )
    top_k: int = field(default=-1, metadata=doc("sample among the k likeliest tokens; -1 keeps all"))
    seed: int | None = field(
        default=None, metadata=doc("the request's own random generator's seed (default: torch's global one)")
    )
    ignore_eos: bool = field(default=False, metadata=doc("keep generating past an end-of-sequence token"))
    return_logits: bool = field(default=False, metadata=doc("keep the logits each output token was sampled from"))
    return_prompt_logits: bool = field(
        default=False, metadata=doc("keep the logits at every prompt position (skips the prefix cache)")
    )

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"expected max_tokens to be a positive int, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"expected temperature >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"expected top_p in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"expected top_k to be -1 or a positive int, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"expected seed to be None or an int, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
