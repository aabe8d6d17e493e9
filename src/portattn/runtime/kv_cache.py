"""What a model caches per token, and the pools that hold it for every layer.

A model states its cache with a :class:`KVCacheSpec`; ``spec.kind`` picks the pool class from
:data:`KV_CACHE_KINDS`, the one table of layouts. A kind's pool class is the one place that knows
the kind: its memory, its per-forward plan beyond the backend's paged metadata (:meth:`KVPool.plan`,
the forward context's ``cache_plan``) and its plan of captured uniform steps
(:meth:`KVPool.graph_plan`); the engine calls these without naming the kind.

* ``"mha"``: per-layer K and V caches ``k [num_pages, P, Hkv, D]``, ``v [num_pages, P, Hkv, Dv]``; an fp8
  V cache (with :data:`FP8_V_KEYS_CONTIGUOUS`) stores each page's keys contiguous, ``[num_pages, Hkv, Dv, P]``
  in memory, the same logical tensor (:func:`keys_contiguous_empty`);
* ``"mla"``: per-layer latent caches ``[num_pages, P, kv_lora_rank + rope_dim]``, one row
  ``[c_kv | k_pe]`` per token shared by every query head (the layout :func:`portattn.mla_decode`
  reads). Pages, ``req_to_token`` and prefix caching are the engine's own: only what a slot holds
  differs between kinds.

A pool's ``dtype`` is the cache's: the model's, or fp8 (``float8_e4m3fn`` / ``float8_e5m2``), whose
slots hold ``saturate(x / scale)`` with one K and one V scale per layer (:meth:`KVPool.kv_scales`;
an ``"mla"`` latent row uses the K scale). Scales are 1.0 unless the engine sets them from the
checkpoint (:meth:`KVPool.set_kv_scales`). The scales belong to the pool: ``kv_cache(layer_id)``
is the layer's view (:class:`~portattn.backends.cache.PagedKVCache` /
:class:`~portattn.backends.cache.LatentKVCache`) with its scales, what the backend writes and reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..backends.cache import LatentKVCache, PagedKVCache
from ..kv_quant import check_scale, is_quantized
from .plan import CacheGraphPlan, LatentAttentionPlan, LatentGraphPlan, plan_latent_attention

if TYPE_CHECKING:
    from ..backends.base import AttentionBackend
    from ..backends.metadata import GraphBuffers, PagedMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    """What one model caches per token: ``num_layers`` layers of ``kind``.

    ``"mha"``: ``num_kv_heads`` heads of ``head_dim`` keys and ``v_head_dim`` values. ``"mla"``
    (built by :func:`mla_cache_spec`): one latent head (``num_kv_heads = 1``) of ``head_dim =
    kv_lora_rank + rope_dim``, no separate values (``v_head_dim = 0``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kind: str = "mha"
    kv_lora_rank: int = 0  # "mla": the c_kv part of each row

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "v_head_dim", "kv_lora_rank"):
            value = getattr(self, name)
            positive = name not in ("v_head_dim", "kv_lora_rank")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and positive):
                raise ValueError(
                    f"expected {name} to be a {'positive' if positive else 'non-negative'} int, got {value!r}"
                )
        if self.kind not in KV_CACHE_KINDS:
            raise ValueError(f"expected a KV cache kind in {sorted(KV_CACHE_KINDS)}, got {self.kind!r}")
        KV_CACHE_KINDS[self.kind].check_spec(self)

    @classmethod
    def mha_from_specs(cls, specs) -> KVCacheSpec:
        """One cache spec for attention layers that all share head counts and dims (their ``AttentionSpec``s)."""
        shapes = {(spec.num_kv_heads, spec.head_dim, spec.v_head_dim) for spec in specs}
        if len(shapes) != 1:
            raise ValueError(f"expected every layer to share (Hkv, D, Dv), got {sorted(shapes)}")
        if [spec.layer_id for spec in specs] != list(range(len(specs))):
            raise ValueError(f"expected layer ids 0..{len(specs) - 1}, got {[spec.layer_id for spec in specs]}")
        ((kv_heads, head_dim, v_head_dim),) = shapes
        return cls(len(specs), kv_heads, head_dim, v_head_dim)

    def bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        return KV_CACHE_KINDS[self.kind].bytes_per_page(self, page_size, dtype)


def mla_cache_spec(num_layers: int, kv_lora_rank: int, rope_dim: int) -> KVCacheSpec:
    """A spec for ``num_layers`` latent caches with rows of ``kv_lora_rank + rope_dim``."""
    for name, value in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    return KVCacheSpec(num_layers, 1, kv_lora_rank + rope_dim, 0, kind="mla", kv_lora_rank=kv_lora_rank)


# fp8 V caches of pages of more than one key are allocated with the keys contiguous within each page
# (keys_contiguous_empty): the Triton kernel's second product then reads four keys a 32-bit register
# from shared memory instead of one byte at a time (kernels/triton/attention.py, V_KEYS). On an H200 an
# e4m3 decode of 64 sequences over 4096 keys took 0.141 ms so against 0.173 (benchmarks/results/round19_h200).
FP8_V_KEYS_CONTIGUOUS = True


def keys_contiguous_empty(num_pages: int, page_size: int, num_heads: int, dim: int, dtype, device) -> torch.Tensor:
    """An uninitialised cache of logical shape ``[num_pages, P, H, dim]`` stored ``[num_pages, H, dim, P]``
    (strides ``(H*dim*P, 1, dim*P, P)``): a page's keys contiguous for each head and column."""
    stored = torch.empty((num_pages, num_heads, dim, page_size), dtype=dtype, device=device)
    return stored.permute(0, 3, 1, 2)


def keys_contiguous(cache: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache [num_pages, P, H, dim]`` stored with each page's keys contiguous
    (:func:`keys_contiguous_empty`): the same values, the same logical shape."""
    return keys_contiguous_empty(*cache.shape, cache.dtype, cache.device).copy_(cache)


class KVPool:
    """Pages of KV cache for every layer. ``kv_cache(layer_id)`` is the layer's view, with its scales,
    which the backend writes and attends over.

    Allocated with ``torch.empty``: a slot is only read after its token's K/V were written.
    ``dtype`` is the cache dtype (the model's, or fp8). ``cascades``: the kind's layers attend through
    the backend's paged attention, so that a batch sharing a prefix may attend through a cascade
    (``engine/cascade_rule.py``).
    """

    cascades: ClassVar[bool] = False

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.spec, self.num_pages, self.page_size, self.dtype, self.device = spec, num_pages, page_size, dtype, device
        self._scales = [(1.0, 1.0)] * spec.num_layers

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of a layer: stored value times scale is the value (1.0 unless fp8)."""
        return self._scales[layer_id]

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """One ``(k_scale, v_scale)`` per layer, positive floats; other than 1.0 only for an fp8 cache."""
        if len(scales) != self.spec.num_layers:
            raise ValueError(f"expected {self.spec.num_layers} (k_scale, v_scale) pairs, got {len(scales)}")
        checked = [(check_scale("k_scale", k), check_scale("v_scale", v)) for k, v in scales]
        if not is_quantized(self.dtype) and any(pair != (1.0, 1.0) for pair in checked):
            raise ValueError(f"expected KV scales of 1.0 for a {self.dtype} cache (scales apply to fp8), got {scales}")
        self._scales = checked

    @staticmethod
    def check_spec(spec: KVCacheSpec) -> None:
        """Raise ``ValueError`` if ``spec`` does not describe this layout."""

    @staticmethod
    def bytes_per_page(spec: KVCacheSpec, page_size: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def kv_cache(self, layer_id: int):
        raise NotImplementedError

    def plan(
        self, backend: AttentionBackend, metadata: PagedMetadata, *, num_heads: int, decode_q_len: int = 1
    ) -> object | None:
        """What this kind's layers read beyond ``metadata``, made once per forward in the plan step (it
        may sync); ``None``: nothing. Sequences of ``1 .. decode_q_len`` new tokens are decodes."""
        return None

    def graph_plan(
        self, buffers: GraphBuffers, shapes: Sequence[tuple[int, int]], *, num_heads: int
    ) -> CacheGraphPlan | None:
        """This kind's plan of captured uniform steps of ``shapes`` ``(batch_size, uniform_q_len)``,
        over the backend's ``buffers``; ``None``: the backend's graph plan is all it needs."""
        return None


class MHAKVPool(KVPool):
    """Per-layer ``k [num_pages, P, Hkv, D]`` and ``v [num_pages, P, Hkv, Dv]`` (an fp8 ``v`` with its keys
    contiguous in each page where :data:`FP8_V_KEYS_CONTIGUOUS` and P > 1)."""

    cascades = True

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(spec, num_pages, page_size, dtype, device)
        shape = (num_pages, page_size, spec.num_kv_heads)
        self.k = [torch.empty((*shape, spec.head_dim), dtype=dtype, device=device) for _ in range(spec.num_layers)]
        if FP8_V_KEYS_CONTIGUOUS and is_quantized(dtype) and page_size > 1:
            self.v = [keys_contiguous_empty(*shape, spec.v_head_dim, dtype, device) for _ in range(spec.num_layers)]
        else:
            self.v = [
                torch.empty((*shape, spec.v_head_dim), dtype=dtype, device=device) for _ in range(spec.num_layers)
            ]

    @staticmethod
    def bytes_per_page(spec: KVCacheSpec, page_size: int, dtype: torch.dtype) -> int:
        per_token = spec.num_kv_heads * (spec.head_dim + spec.v_head_dim) * dtype.itemsize
        return spec.num_layers * page_size * per_token

    def kv_cache(self, layer_id: int) -> PagedKVCache:
        return PagedKVCache(self.k[layer_id], self.v[layer_id], *self._scales[layer_id])


class MLAKVPool(KVPool):
    """Per-layer latent caches ``[num_pages, P, kv_lora_rank + rope_dim]``."""

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(spec, num_pages, page_size, dtype, device)
        shape = (num_pages, page_size, spec.head_dim)
        self.latent = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]

    @staticmethod
    def check_spec(spec: KVCacheSpec) -> None:
        if spec.num_kv_heads != 1 or spec.v_head_dim != 0 or not 0 < spec.kv_lora_rank < spec.head_dim:
            raise ValueError(
                "expected an MLA spec with one latent head, no separate values and 0 < kv_lora_rank < head_dim "
                f"(mla_cache_spec), got num_kv_heads={spec.num_kv_heads}, v_head_dim={spec.v_head_dim}, "
                f"kv_lora_rank={spec.kv_lora_rank}, head_dim={spec.head_dim}"
            )

    @staticmethod
    def bytes_per_page(spec: KVCacheSpec, page_size: int, dtype: torch.dtype) -> int:
        return spec.num_layers * page_size * spec.head_dim * dtype.itemsize

    def kv_cache(self, layer_id: int) -> LatentKVCache:
        return LatentKVCache(self.latent[layer_id], self._scales[layer_id][0])

    def plan(
        self, backend: AttentionBackend, metadata: PagedMetadata, *, num_heads: int, decode_q_len: int = 1
    ) -> LatentAttentionPlan:
        """The latent-attention plan: decodes absorbed, prefill and extend chunks expanded."""
        return plan_latent_attention(
            backend, metadata, num_heads=num_heads, kv_lora_rank=self.spec.kv_lora_rank, decode_q_len=decode_q_len
        )

    def graph_plan(
        self, buffers: GraphBuffers, shapes: Sequence[tuple[int, int]], *, num_heads: int
    ) -> LatentGraphPlan:
        """Every captured step absorbed, one row per new token, with one split-KV workspace."""
        return LatentGraphPlan(buffers, shapes, num_heads=num_heads, kv_lora_rank=self.spec.kv_lora_rank)


# The layouts a KVCacheSpec can name. A new layout is a KVPool subclass (its memory and its plans) added here.
KV_CACHE_KINDS: dict[str, type[KVPool]] = {"mha": MHAKVPool, "mla": MLAKVPool}


def make_kv_pool(spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device) -> KVPool:
    return KV_CACHE_KINDS[spec.kind](spec, num_pages, page_size, dtype, torch.device(device))
