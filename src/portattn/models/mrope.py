"""Multimodal rotary embeddings (Qwen2-VL / Qwen2.5-VL "mrope"): three position rows t, h, w.

Text tokens count up on all three rows; an image's tokens take (frame, row, column) offsets from the
position where the image starts. The rotary frequencies are split by ``mrope_section`` between the rows.
"""

from __future__ import annotations

import torch

from ..errors import expect
from .layers import RotaryEmbedding, _rotate_half


def mrope_positions(
    num_tokens: int, spans: list[tuple[int, int]], grid: list[tuple[int, int, int]], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """Multimodal rotary positions of a prompt: ``([3, num_tokens] int64, delta)`` (rows t, h, w).

    As transformers (5.x) ``get_rope_index`` for images: text tokens count up on all three rows;
    an image of merged grid ``t x h' x w'`` starting at position ``p`` places its tokens at
    ``(p + frame, p + row, p + column)``, and the text after it resumes at ``p + max(h', w')``.
    Tokens past the prompt sit at ``index + delta`` on every row, ``delta = max position + 1 - num_tokens``.
    """
    m = spatial_merge_size
    pieces, current, text_start = [], 0, 0
    for (start, end), (t, h, w) in zip(spans, grid):
        pieces.append(torch.arange(start - text_start).expand(3, -1) + current)  # [3, text]
        current += start - text_start
        gh, gw = h // m, w // m
        frame = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)  # [t, h', w']
        row = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        col = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        pieces.append(torch.stack([frame, row, col]).reshape(3, end - start) + current)  # [3, t*h'*w']
        current += max(h, w) // m
        text_start = end
    pieces.append(torch.arange(num_tokens - text_start).expand(3, -1) + current)
    positions = torch.cat(pieces, dim=1)  # [3, num_tokens]
    return positions, int(positions.max()) + 1 - num_tokens


def placeholder_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every maximal run of ``token_id`` in ``token_ids``."""
    runs, start = [], None
    for i, t in enumerate([*token_ids, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over three position rows: frequency ``i`` rotates by the position on row
    ``axis[i]`` (``mrope_section = [a, b, c]``: the first ``a`` frequencies read t, the next ``b`` h,
    the last ``c`` w)."""

    def __init__(self, config, head_dim: int):
        super().__init__(config, head_dim)
        section = list((getattr(config, "rope_parameters", None) or {}).get("mrope_section") or [])
        expect(
            len(section) == 3 and sum(section) == head_dim // 2,
            f"mrope_section of three sizes summing to head_dim / 2 = {head_dim // 2}",
            section,
        )
        # Built on the CPU: models are constructed under torch.device("meta"); buffers must be real.
        axis = torch.cat([torch.full((n,), i, device="cpu") for i, n in enumerate(section)])  # [D / 2]
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, :, None].float() * self.inv_freq  # [3, T, D / 2]
        freqs = freqs.gather(0, self.axis.expand(1, freqs.shape[1], -1))[0]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.scaling).to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = (emb.sin() * self.scaling).to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
