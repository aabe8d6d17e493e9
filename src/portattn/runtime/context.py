"""The one object a model's layers read besides their inputs, built by the engine once per forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..backends.base import AttentionBackend
    from ..backends.metadata import PagedMetadata
    from .kv_cache import KVPool
    from .multimodal import MultimodalBatch


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """One forward's plan and caches, passed explicitly to every layer (never a module global).

    ``metadata``: the backend's paged plan (page table, lengths, the new tokens' slots);
    ``cache_plan``: what the KV cache kind plans beyond it (``kv_pool.plan``: the latent-attention
    plan of an ``"mla"`` cache, ``None`` for ``"mha"``); ``multimodal``: image embeddings and rotary
    positions when the batch has images. Everything in it was made before the model runs: no layer
    syncs with the device.
    """

    backend: AttentionBackend
    metadata: PagedMetadata
    kv_pool: KVPool
    cache_plan: object | None = None
    multimodal: MultimodalBatch | None = None

    def kv_cache(self, layer_id: int):
        """The layer's cache view (``PagedKVCache`` or ``LatentKVCache``), its fp8 scales included."""
        return self.kv_pool.kv_cache(layer_id)
