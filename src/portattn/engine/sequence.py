"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..runtime.multimodal import MultimodalData
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .sampler import TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Prompt plus output tokens, and where their K/V live.

    The K/V of ``token_ids[:num_computed]`` are in the pool; ``pages[p]`` holds tokens
    ``p * P .. p * P + P - 1``. ``page_hashes[p]`` is the prefix-cache key of full, computed page ``p``.
    ``multimodal`` holds the prompt's images (``None`` for a text prompt).
    ``sample_key`` keys the sequence's random stream (see :mod:`.sampler`); ``index`` is its choice
    number among the ``n`` of its request. ``bad_word_ids`` are the token sequences of its
    ``params.bad_words`` (:meth:`Engine.add_request` tokenizes them). ``detokenizer`` holds the
    output's text (``None`` without a tokenizer). ``stop_reason`` is the stop string or stop token
    id that finished it, if any.
    After a step that computes the last token, one new token is sampled and appended, so a running
    sequence in decode has ``num_computed == num_tokens - 1``. With speculative decoding, the last
    ``num_draft_tokens`` of ``token_ids`` are proposed tokens that the step verifies; they are removed
    (and the accepted ones appended again) before the step ends, so between steps it is 0.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_key: int = 0
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_draft_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)
    req_pool_idx: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    num_prompt_scored: int = 0  # prompt positions whose logits were taken (prompt logits / logprobs)
    multimodal: MultimodalData | None = None
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """How many tokens have been generated (no copy: the per-step checks use this)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]
