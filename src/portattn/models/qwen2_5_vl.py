"""Qwen2.5-VL: the vision tower, and the whole model (tower + Qwen2 language model with mrope).

The vision tower: patch embedding, 2D rotary, window/full attention blocks, patch merger.

Computes what ``transformers``' ``Qwen2_5_VisionTransformerPretrainedModel`` computes (its
``pooler_output``, the merged image embeddings), with attention through portattn's ``mm`` backend:

* the input is the processor's ``pixel_values [N, C * T * P * P]`` (``N = sum(t * h * w)`` patches,
  in merge-block order) and ``image_grid_thw [num_images, 3]``;
* tokens are reordered once into *window order* (windows of ``window_size // patch_size`` patches
  per side, i.e. ``window_units`` merge units); blocks in ``fullatt_block_indexes`` attend within
  each frame, the others within each window; images never see each other;
* the rotary embedding is axial: half of each head's rotary angles come from the patch row, half
  from the column;
* the merger turns each merge block of ``m * m`` tokens into one embedding, and the embeddings are
  put back in input order.

Everything that depends on the grids (sequence offsets, max lengths, the window permutation and the
patch positions) is planned once per forward into an :class:`~portattn.encoder.EncoderSeqInfo`;
the blocks only launch work.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ..backends.base import AttentionLayer
from ..encoder import EncoderAttention, EncoderSeqInfo, grid_list
from ..engine.multimodal import MultimodalData, image_key
from ..errors import expect
from .layers import CausalLM, ForwardContext, GatedMLP, PagedAttention, RMSNorm
from .llama import window_left_of
from .mrope import MRotaryEmbedding, mrope_positions, placeholder_runs

logger = logging.getLogger("portattn")

_NORM_EPS = 1e-6  # fixed in Qwen2.5-VL's vision tower (not in the config)
_CHECKPOINT_PREFIXES = ("model.visual.", "visual.")  # transformers >= 4.52 / the original checkpoints


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [N, H, D]``, ``cos, sin [N, D]`` float32 -> rotated in float32, returned in q's dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
    qf, kf = q.float(), k.float()
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


class PatchEmbed(nn.Module):
    """A Conv3d whose stride equals its kernel: one matmul over flattened patches."""

    def __init__(self, config):
        super().__init__()
        t, p = config.temporal_patch_size, config.patch_size
        kernel = (t, p, p)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=False)
        self.patch_dim = config.in_channels * t * p * p

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.flatten(1)  # [E, C * T * P * P]
        return F.linear(pixel_values.to(weight.dtype), weight)  # [N, E]


class VisionAttention(nn.Module):
    def __init__(self, config, attention: EncoderAttention):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.attention = attention  # shared by all blocks; not a module

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], seq) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [N, H, D]
        q, k = apply_rotary(q, k, *rotary)
        out = self.attention(q, k, v, seq)  # [N, H, D]
        return self.proj(out.view(n, self.num_heads * self.head_dim))  # [N, dim]


class VisionBlock(nn.Module):
    def __init__(self, config, attention: EncoderAttention, full_attention: bool):
        super().__init__()
        self.full_attention = full_attention
        self.norm1 = RMSNorm(config.hidden_size, _NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, _NORM_EPS)
        self.attn = VisionAttention(config, attention)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], info: EncoderSeqInfo):
        x = x + self.attn(self.norm1(x), rotary, info.metadata(self.full_attention))
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then an MLP over each merge block's ``m * m`` concatenated tokens."""

    def __init__(self, config):
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, _NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))  # [N, E] -> [U, m*m*E] -> [U, out]


class Qwen2_5_VisionTransformer(nn.Module):
    """The vision tower of ``Qwen2_5_VLForConditionalGeneration`` (``config`` = its ``vision_config``).

    ``mm_attention_backend`` (a name or ``"auto"``) is resolved here, once, for ``dtype`` on
    ``device`` (an unsupported feature, head dim or dtype raises
    :class:`~portattn.UnsupportedFeatureError` now, not in the first forward). Parameters are
    created on the current default device; :func:`load_vision_tower` builds, loads and moves them.
    """

    def __init__(
        self,
        config,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        mm_attention_backend: str = "auto",
    ):
        super().__init__()
        self.config = config
        expect(config.hidden_size % config.num_heads == 0, "hidden_size divisible by num_heads", config.num_heads)
        self.head_dim = config.hidden_size // config.num_heads
        expect(self.head_dim % 4 == 0, "a head dim divisible by 4 (two axes, rotate-half)", self.head_dim)
        rope = getattr(config, "rope_parameters", None) or {}
        expect(rope.get("rope_type", "axial") == "axial", "rope_type 'axial'", rope.get("rope_type"))
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.window_units = config.window_size // config.spatial_merge_size // config.patch_size
        expect(self.window_units >= 1, "window_size >= spatial_merge_size * patch_size", config.window_size)
        full = set(config.fullatt_block_indexes)
        expect(full <= set(range(config.depth)), f"fullatt_block_indexes in [0, {config.depth})", sorted(full))

        self.attention = EncoderAttention(
            config.num_heads, self.head_dim, dtype=dtype, device=device, backend=mm_attention_backend
        )
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config, self.attention, i in full) for i in range(config.depth))
        self.merger = PatchMerger(config)

    @property
    def device(self) -> torch.device:
        return self.merger.mlp[0].weight.device

    def plan(self, grid_thw: torch.Tensor) -> EncoderSeqInfo:
        """Sequences, windows and positions of one forward (its only host sync)."""
        return self.attention.plan(
            grid_thw, spatial_merge_size=self.spatial_merge_size, window_units=self.window_units, device=self.device
        )

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N, 2]`` (row, column) -> ``cos, sin [N, D]`` float32."""
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.rope_theta ** (quarter / (self.head_dim // 2)))  # [D / 4]
        angles = (positions[:, :, None].float() * inv_freq).flatten(1)  # [N, 2, D/4] -> [N, D/2] (rows | cols)
        emb = torch.cat((angles, angles), dim=-1)  # [N, D]
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged image embeddings ``[sum(t * h * w) / m**2, out_hidden_size]``, images in input order.

        ``pixel_values [N, C * T * P * P]`` and ``grid_thw [num_images, 3]`` as the Hugging Face
        processor returns them (``image_grid_thw``); ``N`` must equal ``sum(t * h * w)``.
        """
        patch_dim = self.patch_embed.patch_dim
        expect(
            isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 2 and pixel_values.shape[1] == patch_dim,
            f"pixel_values of shape [num_patches, {patch_dim}]",
            list(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__,
        )
        expect(pixel_values.is_floating_point(), "floating-point pixel_values", pixel_values.dtype)
        info = self.plan(grid_thw)
        expect(
            pixel_values.shape[0] == info.num_tokens,
            f"{info.num_tokens} patches in pixel_values (sum of t*h*w over grid_thw)",
            pixel_values.shape[0],
        )
        return self.run(pixel_values.to(self.device), info)

    def run(self, pixel_values: torch.Tensor, info: EncoderSeqInfo) -> torch.Tensor:
        """The forward after planning: no host sync (every length is a Python int in ``info``)."""
        x = info.to_window_order(self.patch_embed(pixel_values))  # [N, E] window order
        rotary = self.rotary(info.positions)
        for block in self.blocks:
            x = block(x, rotary, info)
        return info.from_window_order(self.merger(x))  # [U, out] input order


def load_vision_tower(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    mm_attention_backend: str = "auto",
    config=None,
) -> Qwen2_5_VisionTransformer:
    """The vision tower of a Qwen2.5-VL checkpoint directory, weights from its safetensors.

    Reads tensors under ``visual.`` or ``model.visual.`` (both layouts that transformers writes);
    every tower weight must be present with its expected shape.
    """
    from . import loader

    path = Path(path)
    config = config if config is not None else loader.load_config(path)
    vision_config = getattr(config, "vision_config", None)
    expect(
        vision_config is not None and getattr(config, "model_type", None) == "qwen2_5_vl",
        "a Qwen2.5-VL checkpoint (model_type 'qwen2_5_vl')",
        getattr(config, "model_type", None),
    )
    device = torch.device(device)
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformer(
            vision_config, dtype=dtype, device=device, mm_attention_backend=mm_attention_backend
        )
    expected = dict(tower.named_parameters())
    state = {}
    for file in loader.safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                prefix = next((p for p in _CHECKPOINT_PREFIXES if key.startswith(p)), None)
                if prefix is None:
                    continue
                name = key[len(prefix) :]
                expect(name in expected, "tensors of the Qwen2.5-VL vision tower", f"unknown tensor {key!r}")
                tensor = f.get_tensor(key)
                expect(
                    tuple(tensor.shape) == tuple(expected[name].shape),
                    f"{key} of shape {list(expected[name].shape)}",
                    list(tensor.shape),
                )
                state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    expect(not missing, "every vision-tower weight in the checkpoint", f"missing {missing[:5]}")
    tower.load_state_dict(state, strict=True, assign=True)
    tower.eval().requires_grad_(False)
    logger.info("loaded the Qwen2.5-VL vision tower from %s (%s, %s)", path, dtype, device)
    return tower


# -- the language model and the whole checkpoint ---------------------------------------------------


class Qwen2Attention(nn.Module):
    """Qwen2 attention: biases on q, k and v (not on o); sliding-window layers from ``layer_types``."""

    def __init__(self, config, layer_id: int):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim = config.hidden_size // heads
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        spec = AttentionLayer(
            layer_id, heads, kv_heads, head_dim, scale=head_dim**-0.5, window_left=window_left_of(config, layer_id)
        )
        self.attn = PagedAttention(spec)

    def forward(self, positions, x, ctx: ForwardContext, rotary: MRotaryEmbedding) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, -1, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(n, -1, self.head_dim)  # [T, Hkv, D]
        q, k = rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, self.v_proj(x), ctx))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = Qwen2Attention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, ctx, rotary) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2_5_VLTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(config, config.hidden_size // config.num_attention_heads)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [T, H]`` input embeddings, ``positions [3, T]`` -> final hidden states ``[T, H]``."""
        for layer in self.layers:
            x = layer(positions, x, ctx, self.rotary_emb)
        return self.norm(x)


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    """Qwen2.5-VL: the vision tower, and a Qwen2 language model with multimodal rotary positions.

    The tower's attention runs on ``mm_attention_backend`` (resolved once here, for ``dtype`` on
    ``device``). Prompts with images come in through :meth:`multimodal_data`; the engine hands each
    forward's image embeddings and ``[3, T]`` positions to :meth:`forward` as ``ctx.multimodal``.
    """

    is_multimodal = True

    def __init__(
        self,
        config,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        mm_attention_backend: str = "auto",
    ):
        super().__init__(config)
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
        self.model = Qwen2_5_VLTextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` (used when no sequence of the batch has images)."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        mm = getattr(ctx, "multimodal", None)
        if mm is None:
            return self.model(x, positions.expand(3, -1), ctx)  # text only: t = h = w = index
        if mm.embed_rows is not None:
            x = x.index_copy(0, mm.embed_rows, mm.embeds.to(x.dtype))
        return self.model(x, mm.positions, ctx)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw) -> torch.Tensor:
        """Merged image embeddings ``[sum(t*h*w) / merge**2, H]``, images in input order."""
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

    def checkpoint_name(self, name: str) -> str | None:
        """transformers >= 4.52 (``model.language_model.*``, ``model.visual.*``) and the original
        layout (``model.*``, ``visual.*``)."""
        for prefix in _CHECKPOINT_PREFIXES:
            if name.startswith(prefix):
                return "visual." + name[len(prefix) :]
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        return super().checkpoint_name(name)
