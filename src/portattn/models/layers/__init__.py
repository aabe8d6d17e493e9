"""Building blocks of the model families, one concept per file; a family is a composition of these.

Each block computes exactly what its Hugging Face counterpart computes (same dtype casts, same order
of operations), so that the engine's logits match ``transformers`` to float rounding.
"""

from .activation import ACTIVATIONS, ClampedSwiGLU, activation, gated
from .attention import PagedAttention, SelfAttention, attention_spec, head_dim_of, window_left_of
from .decoder import DecoderLayer, run_decoder
from .embedding import Embedding, LMHead, VocabParallel
from .latent_attention import MultiheadLatentAttention
from .linear import (
    FUSED,
    CheckpointSlice,
    ColumnParallelLinear,
    Linear,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    WeightShapeError,
    as_tensor,
    default_weight_loader,
    new_parameter,
)
from .mlp import GatedMLP
from .moe import FusedMoE, SoftmaxTopKMoE, per_expert_checkpoint_name
from .norm import RMSNorm, l2_norm
from .quant import dequantize_mxfp4
from .rotary import (
    InterleavedRotaryEmbedding,
    MRotaryEmbedding,
    PartialRotaryEmbedding,
    RotaryEmbedding,
    apply_rotary_float32,
    rope_inv_freq,
    rotate_half,
)

__all__ = [
    "ACTIVATIONS",
    "FUSED",
    "CheckpointSlice",
    "ClampedSwiGLU",
    "ColumnParallelLinear",
    "DecoderLayer",
    "Embedding",
    "FusedMoE",
    "GatedMLP",
    "InterleavedRotaryEmbedding",
    "LMHead",
    "Linear",
    "MRotaryEmbedding",
    "MergedLinear",
    "MultiheadLatentAttention",
    "PagedAttention",
    "PartialRotaryEmbedding",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SelfAttention",
    "SoftmaxTopKMoE",
    "VocabParallel",
    "WeightShapeError",
    "activation",
    "apply_rotary_float32",
    "as_tensor",
    "attention_spec",
    "default_weight_loader",
    "dequantize_mxfp4",
    "gated",
    "head_dim_of",
    "l2_norm",
    "new_parameter",
    "per_expert_checkpoint_name",
    "rope_inv_freq",
    "rotate_half",
    "run_decoder",
    "window_left_of",
]
