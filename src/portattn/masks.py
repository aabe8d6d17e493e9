"""Which keys a query sees, as small pure functions.

Every mask in portattn is an inclusive key range ``[lo, hi]`` per query position ``p``:

* causal: ``hi = p``; otherwise ``hi = p + window_right`` (unbounded when ``window_right < 0``);
* ``window_left = W >= 0``: ``lo = p - W`` (``W = -1``: no left bound);
* ``attention_chunk_size = C``: ``lo >= (p // C) * C`` and ``hi <= (p // C) * C + C - 1``.

For ``causal``, ``window_left = 2``, keys 0..5 and queries at positions 2..5 (``x`` = visible)::

    p=2  x x x . . .
    p=3  . x x x . .
    p=4  . . x x x .
    p=5  . . . x x x

Queries are bottom-right aligned: with ``n`` queries over ``L`` keys, query ``i`` sits at position
``L - n + i``.
"""

from __future__ import annotations

import torch

UNBOUNDED = 1 << 62


def query_positions(num_queries: int, num_keys: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Absolute positions of ``num_queries`` bottom-right aligned queries over ``num_keys`` keys."""
    return torch.arange(num_keys - num_queries, num_keys, device=device)


def key_range(
    q_pos: torch.Tensor,
    *,
    causal: bool,
    window_left: int = -1,
    window_right: int = -1,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive bounds ``(lo, hi)`` of the keys each query position sees."""
    lo = q_pos - window_left if window_left >= 0 else torch.full_like(q_pos, -UNBOUNDED)
    if causal:
        hi = q_pos
    elif window_right >= 0:
        hi = q_pos + window_right
    else:
        hi = torch.full_like(q_pos, UNBOUNDED)
    if chunk is not None:
        chunk_start = torch.div(q_pos, chunk, rounding_mode="floor") * chunk
        lo = torch.maximum(lo, chunk_start)
        hi = torch.minimum(hi, chunk_start + chunk - 1)
    return lo, hi


def range_mask(lo: torch.Tensor, hi: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[..., n, L]`` boolean mask: key ``k_pos[j]`` is visible to query ``i`` iff ``lo[i] <= k_pos[j] <= hi[i]``.

    ``lo`` and ``hi`` are ``[..., n]`` (any leading batch dims), ``k_pos`` is ``[L]``.
    """
    return (k_pos >= lo[..., None]) & (k_pos <= hi[..., None])
