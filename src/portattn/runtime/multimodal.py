"""Images in prompts: what one request carries, and what one forward needs of it (the types).

A multimodal request holds its images' patches and grids, the prompt span of each image's
placeholder (pad) tokens, a content key per image, and its multimodal rotary positions
``[3, num_prompt_tokens]`` (rows t, h, w), plus the offset that places generated tokens after them.

Image embeddings are computed once per request, in the engine's plan step (``engine/multimodal.py``).
They replace the placeholders' token embeddings wherever a forward's tokens cut the spans (a prefill
chunk may end inside an image).

The prefix cache keys a page by its tokens and, for every image whose placeholder span overlaps
the page, that image's content key (pixels and grid): equal token ids with different images never
share a page, and the chained keys make every later page differ too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def image_key(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> bytes:
    """Content key of one image: its grid, dtype and patch bytes ``[t*h*w, patch_dim]``."""
    pixels = pixel_values.detach().contiguous().cpu()
    header = f"{tuple(grid)}|{pixels.dtype}|{tuple(pixels.shape)}".encode()
    return hashlib.blake2b(header + pixels.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class MultimodalData:
    """The images of one prompt (built by the model's ``multimodal_data``, validated there).

    ``pixel_values [N, patch_dim]``: the patches of every image, image after image (the processor's
    layout, ``N = sum(t * h * w)``); ``grid``: ``(t, h, w)`` per image; ``spans``: ``[start, end)``
    of each image's placeholder tokens in the prompt (``end - start`` = its merged patch count);
    ``keys``: content key per image; ``positions [3, num_prompt_tokens]`` int64 (CPU);
    ``position_delta``: token ``i`` past the prompt sits at position ``i + position_delta`` on all rows.
    """

    pixel_values: torch.Tensor
    grid: list[tuple[int, int, int]]
    spans: list[tuple[int, int]]
    keys: list[bytes]
    positions: torch.Tensor
    position_delta: int
    embeds: torch.Tensor | None = None  # [sum of span lengths, H] while the prompt's images are prefilled

    @property
    def num_image_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def content_key(self, first: int, last: int) -> bytes:
        """Keys of the images whose spans overlap tokens ``[first, last)`` (empty when none)."""
        return b"".join(key for (s, e), key in zip(self.spans, self.keys) if s < last and e > first)

    def overlaps_images(self, first: int, last: int) -> bool:
        return any(s < last and e > first for s, e in self.spans)

    def positions_of(self, first: int, last: int) -> torch.Tensor:
        """``[3, last - first]`` int64 positions of tokens ``[first, last)`` (CPU)."""
        num_prompt = self.positions.shape[1]
        prompt = self.positions[:, first : min(last, num_prompt)]  # [3, prompt part]
        if last <= num_prompt:
            return prompt
        generated = torch.arange(max(first, num_prompt), last) + self.position_delta  # [n]
        return torch.cat([prompt, generated.expand(3, -1)], dim=1)


@dataclass(frozen=True, eq=False)
class MultimodalBatch:
    """One forward's multimodal inputs: ``positions [3, T]`` int64 (rows t, h, w of every new token),
    and ``embeds [M, H]`` that replace the token embeddings at rows ``embed_rows [M]`` int64 of the
    forward's ``T`` tokens (``None`` when no placeholder is among them)."""

    positions: torch.Tensor
    embeds: torch.Tensor | None
    embed_rows: torch.Tensor | None
