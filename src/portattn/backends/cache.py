"""One layer's KV cache as a backend's engine entry points get it: the tensors and their scales.

The engine's pool (:mod:`portattn.runtime.kv_cache`) holds every layer's cache and gives each layer
one of these views per forward (``ForwardContext.kv_cache(layer_id)``). The backend is the one
writer of what a view holds (``AttentionBackend.write_kv`` / ``write_latent``, called by its
``forward`` / ``forward_rotary`` or by the MLA layer). The scales of an fp8 cache belong to the
cache: set once per layer (from the checkpoint), carried by the view, read by every write and every
read of that layer; no caller passes them per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class PagedKVCache:
    """One layer's K and V caches, in the model's dtype or fp8 (the two share one dtype): contiguous, except
    an fp8 ``v`` that the pool stores with each page's keys contiguous (``[N, Hkv, Dv, P]`` in memory, the
    same logical tensor; ``runtime.kv_cache.FP8_V_KEYS_CONTIGUOUS``).

    A slot is ``page * P + offset``. An fp8 cache stores ``saturate(k / k_scale)`` and
    ``saturate(v / v_scale)`` (:func:`portattn.kv_quant.quantize_kv`); the keys and values it stands for
    are the stored values times the scales. Scales are 1.0 for a cache in the model's dtype.
    """

    k: torch.Tensor  # [num_pages, P, Hkv, D]
    v: torch.Tensor  # [num_pages, P, Hkv, Dv]
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True, eq=False)
class LatentKVCache:
    """One MLA layer's latent cache: one row ``[c_kv | k_pe]`` per token, shared by every query head.

    ``latent [num_pages, P, R + Dr]`` contiguous, in the model's dtype or fp8; an fp8 cache stores
    ``saturate(row / scale)`` (one scale for ``c_kv`` and ``k_pe`` alike; 1.0 otherwise).
    """

    latent: torch.Tensor  # [num_pages, P, R + Dr]
    scale: float = 1.0
