"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the vision tower and a Qwen2 language model
with multimodal rotary positions ("mrope": three position rows t, h, w).

Text tokens count up on all three rows; an image's tokens take (frame, row, column) offsets from the
position where the image starts. The rotary frequencies are split by ``mrope_section`` between the rows.
"""

from __future__ import annotations

import itertools

import torch

from ..distributed.group import TPGroup
from ..encoder import EncoderSeqInfo, grid_list
from ..errors import expect
from ..runtime.context import ForwardContext
from ..runtime.multimodal import MultimodalData, image_key
from .base import CausalLM
from .layers import LMHead, MRotaryEmbedding, head_dim_of
from .llama import LlamaModel, self_attention
from .qwen2_5_vl_vision import CHECKPOINT_PREFIXES, Qwen2_5_VisionTransformer, tower_checkpoint_name


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


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    """Qwen2.5-VL: the vision tower, and a Qwen2 language model with multimodal rotary positions.

    The tower's attention runs on ``mm_attention_backend`` (resolved once here, for ``dtype`` on
    ``device``). Prompts with images come in through :meth:`multimodal_data`; the engine hands each
    forward's image embeddings and ``[3, T]`` positions to :meth:`forward` as ``ctx.multimodal``.

    Under tensor parallelism the language model is sharded and the vision tower replicated: every
    rank encodes the step's images itself (the tower runs once per image, in prefill; sharding it
    would add two all-reduces per block to save a tenth of the weights).
    """

    supports_tensor_parallel = True

    def __init__(
        self,
        config,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        mm_attention_backend: str = "auto",
        tp: TPGroup | None = None,
    ):
        super().__init__(config)
        self.tp = tp
        text = config.text_config
        expect(
            config.vision_config.out_hidden_size == text.hidden_size,
            f"vision out_hidden_size equal to the text hidden_size {text.hidden_size}",
            config.vision_config.out_hidden_size,
        )
        self.image_token_id = config.image_token_id
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.visual = Qwen2_5_VisionTransformer(
            config.vision_config, dtype=dtype, device=device, mm_attention_backend=mm_attention_backend
        )
        rotary = MRotaryEmbedding(text, head_dim_of(text))
        self.model = LlamaModel(text, self._attention, rotary, tp=tp)
        self.lm_head = LMHead(text.hidden_size, text.vocab_size, tp=tp)

    def _attention(self, config, layer_id: int):
        return self_attention(config, layer_id, qkv_bias=True, o_bias=False, qk_norm=False, tp=self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` (used when no sequence of the batch has images)."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        mm = ctx.multimodal
        if mm is None:
            return self.model.run(x, positions.expand(3, -1), ctx)  # text only: t = h = w = index
        if mm.embed_rows is not None:
            x = x.index_copy(0, mm.embed_rows, mm.embeds.to(x.dtype))
        return self.model.run(x, mm.positions, ctx)

    def plan_images(self, image_grid_thw) -> EncoderSeqInfo:
        """The vision tower's sequences, windows and positions for these images (its host syncs)."""
        return self.visual.plan(image_grid_thw)

    def encode_planned_images(self, pixel_values: torch.Tensor, plan: EncoderSeqInfo) -> torch.Tensor:
        """Merged image embeddings ``[sum(t*h*w) / merge**2, H]`` of planned images (no host sync)."""
        return self.visual.run(pixel_values, plan)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw) -> torch.Tensor:
        """Merged image embeddings ``[sum(t*h*w) / merge**2, H]``, images in input order (plan, then run)."""
        return self.visual(pixel_values, image_grid_thw)

    def multimodal_data(
        self, token_ids: list[int], pixel_values: torch.Tensor | None, image_grid_thw
    ) -> MultimodalData | None:
        """Validate a prompt's image placeholders against its images; ``None`` for a text prompt.

        Each image's placeholders are one run of ``image_token_id`` tokens, as many as its merged
        patches (``t * h * w / merge**2``), runs in image order.
        """
        runs = placeholder_runs(token_ids, self.image_token_id)
        if pixel_values is None and image_grid_thw is None:
            expect(not runs, "multi_modal_data for the prompt's image pad tokens", f"{len(runs)} runs and no images")
            return None
        expect(
            pixel_values is not None and image_grid_thw is not None,
            "both pixel_values and image_grid_thw in multi_modal_data",
            "only one of them",
        )
        m = self.spatial_merge_size
        grid = grid_list(image_grid_thw, m)
        patch_dim = self.visual.patch_embed.patch_dim
        expect(
            isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 2 and pixel_values.shape[1] == patch_dim,
            f"pixel_values of shape [num_patches, {patch_dim}]",
            list(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__,
        )
        expect(pixel_values.is_floating_point(), "floating-point pixel_values", pixel_values.dtype)
        patches = [t * h * w for t, h, w in grid]
        expect(pixel_values.shape[0] == sum(patches), f"{sum(patches)} patches (sum of t*h*w)", pixel_values.shape[0])
        expect(
            len(runs) == len(grid),
            f"{len(grid)} runs of image pad tokens (id {self.image_token_id}), one per image",
            len(runs),
        )
        for i, ((start, end), (t, h, w)) in enumerate(zip(runs, grid)):
            expect(
                end - start == t * h * w // m**2,
                f"{t * h * w // m**2} image pad tokens for image {i} (grid {t}x{h}x{w}, merge {m})",
                end - start,
            )
        offsets = [0, *itertools.accumulate(patches)]
        keys = [image_key(pixel_values[offsets[i] : offsets[i + 1]], g) for i, g in enumerate(grid)]
        positions, delta = mrope_positions(len(token_ids), runs, grid, m)
        return MultimodalData(pixel_values, grid, runs, keys, positions, delta)

    def expand_placeholders(self, token_ids: list[int], image_grid_thw) -> list[int]:
        """Widen each single image pad token to its image's merged patch count (the processor's
        expansion of ``<|image_pad|>``); runs already of the full width are kept."""
        grid = grid_list(image_grid_thw, self.spatial_merge_size)
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) != len(grid) or any(end - start != 1 for start, end in runs):
            return list(token_ids)
        out, prev = [], 0
        for (start, _), (t, h, w) in zip(runs, grid):
            out += token_ids[prev:start] + [self.image_token_id] * (t * h * w // self.spatial_merge_size**2)
            prev = start + 1
        return out + token_ids[prev:]

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """transformers >= 4.52 (``model.language_model.*``, ``model.visual.*``) and the original
        layout (``model.*``, ``visual.*``)."""
        if name.startswith(CHECKPOINT_PREFIXES):
            param, shard = tower_checkpoint_name(name)
            return "visual." + param, shard
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        return super().checkpoint_name(name)
