"""The Qwen2.5-VL vision tower: patch embedding, 2D rotary, window/full attention blocks, patch merger.

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
patch positions) is planned once per forward into an :class:`~portattn.encoder.EncoderSeqInfo`
(:meth:`Qwen2_5_VisionTransformer.plan`, the tower's only host sync); :meth:`~Qwen2_5_VisionTransformer.run`
only launches work.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..encoder import EncoderAttention, EncoderSeqInfo
from ..errors import expect
from .layers import GatedMLP, Linear, RMSNorm, apply_rotary_float32

logger = logging.getLogger("portattn")

_NORM_EPS = 1e-6  # fixed in Qwen2.5-VL's vision tower (not in the config)
CHECKPOINT_PREFIXES = ("model.visual.", "visual.")  # transformers >= 4.52 / the original checkpoints


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
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)
        self.attention = attention  # shared by all blocks; not a module

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], seq) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [N, H, D]
        q, k = apply_rotary_float32(q, k, *rotary)
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
            Linear(self.merged_dim, self.merged_dim, bias=True),
            nn.GELU(),
            Linear(self.merged_dim, config.out_hidden_size, bias=True),
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

    quantizable = False  # quantization="fp8" leaves the tower in the model's dtype

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


def tower_checkpoint_name(name: str) -> tuple[str, object] | None:
    """A checkpoint tensor of the tower (under ``visual.`` or ``model.visual.``, both layouts transformers
    writes) -> ``(parameter of the tower, shard)``; ``None`` for the rest of the checkpoint."""
    prefix = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        return None
    parts = name[len(prefix) :].split(".")
    for i, part in enumerate(parts[:-1]):
        if part in _PACKED:
            merged, shard = _PACKED[part]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), shard
    return ".".join(parts), None


_PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_vision_tower(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    mm_attention_backend: str = "auto",
    config=None,
) -> Qwen2_5_VisionTransformer:
    """The vision tower of a Qwen2.5-VL checkpoint directory, weights from its safetensors.

    Every tower weight must be present with its expected shape.
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
    with torch.device(device), loader.default_dtype(dtype):
        tower = Qwen2_5_VisionTransformer(
            vision_config, dtype=dtype, device=device, mm_attention_backend=mm_attention_backend
        )
    loader.load_weights(
        tower, loader.safetensors_files(path), tower_checkpoint_name, what="the Qwen2.5-VL vision tower"
    )
    tower.eval().requires_grad_(False)
    logger.info("loaded the Qwen2.5-VL vision tower from %s (%s, %s)", path, dtype, device)
    return tower
