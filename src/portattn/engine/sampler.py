"""Greedy, temperature, top-k and top-p sampling, with a generator per seeded request."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled ``[V]`` float32 logits with tokens outside top-k / top-p set to -inf."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest head of the distribution whose mass reaches top_p (the top token always).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits [N, V]``; a single host sync for the whole batch."""
    tokens = torch.argmax(logits, dim=-1)  # [N]; greedy rows keep this
    for i, p in enumerate(params):
        if not p.greedy:
            probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens.tolist()
