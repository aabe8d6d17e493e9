"""The KV pool (per-layer paged caches) and ``req_to_token`` (each request's slots, token-granular).

A model states what it caches with a :class:`KVCacheSpec`; :func:`make_kv_pool` builds the pool
registered for ``spec.kind``. ``"mha"`` is per-layer K and V caches ``[num_pages, P, Hkv, D]``;
other layouts (an MLA latent cache ``[num_pages, P, 1, kv_lora_rank + rope_dim]``) register their
own :class:`KVPool` subclass with :func:`register_kv_pool`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What one model caches per token: ``num_layers`` layers of ``kind`` ("mha": K and V heads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kind: str = "mha"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or (value == 0 and name != "v_head_dim"):
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if self.kind not in _POOLS:
            raise ValueError(f"expected a KV pool kind in {sorted(_POOLS)}, got {self.kind!r}")

    @classmethod
    def mha_from_layers(cls, layers) -> KVCacheSpec:
        """One spec for attention layers that all share head counts and dims (``AttentionLayer``s)."""
        shapes = {(layer.num_kv_heads, layer.head_dim, layer.v_head_dim) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"expected every layer to share (Hkv, D, Dv), got {sorted(shapes)}")
        if [layer.layer_id for layer in layers] != list(range(len(layers))):
            raise ValueError(f"expected layer ids 0..{len(layers) - 1}, got {[layer.layer_id for layer in layers]}")
        ((kv_heads, head_dim, v_head_dim),) = shapes
        return cls(len(layers), kv_heads, head_dim, v_head_dim)

    def bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        return _POOLS[self.kind].bytes_per_page(self, page_size, dtype)


class KVPool:
    """Pages of KV cache for every layer. ``kv_cache(layer_id)`` is what the backend's ``forward`` gets."""

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.spec, self.num_pages, self.page_size, self.dtype, self.device = spec, num_pages, page_size, dtype, device

    @staticmethod
    def bytes_per_page(spec: KVCacheSpec, page_size: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def kv_cache(self, layer_id: int):
        raise NotImplementedError


class MHAKVPool(KVPool):
    """Per-layer ``k [num_pages, P, Hkv, D]`` and ``v [num_pages, P, Hkv, Dv]``.

    Allocated with ``torch.empty``: a slot is only read after its token's K/V were written.
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(spec, num_pages, page_size, dtype, device)
        shape = (num_pages, page_size, spec.num_kv_heads)
        self.k = [torch.empty((*shape, spec.head_dim), dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.empty((*shape, spec.v_head_dim), dtype=dtype, device=device) for _ in range(spec.num_layers)]

    @staticmethod
    def bytes_per_page(spec: KVCacheSpec, page_size: int, dtype: torch.dtype) -> int:
        per_token = spec.num_kv_heads * (spec.head_dim + spec.v_head_dim) * dtype.itemsize
        return spec.num_layers * page_size * per_token

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]


_POOLS: dict[str, type[KVPool]] = {"mha": MHAKVPool}


def register_kv_pool(kind: str, cls: type[KVPool]) -> None:
    _POOLS[kind] = cls


def make_kv_pool(spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device) -> KVPool:
    return _POOLS[spec.kind](spec, num_pages, page_size, dtype, torch.device(device))


class ReqToTokenPool:
    """``req_to_token [max_reqs, max_context]`` int32 and its free rows.

    Token-granular: column ``i`` of a request's row is the slot of its token ``i``. ``max_context``
    is a multiple of the page size so that whole pages can always be written.
    """

    def __init__(self, max_reqs: int, max_context: int, page_size: int, device):
        if max_context % page_size:
            raise ValueError(f"expected max_context to be a multiple of page_size {page_size}, got {max_context}")
        self.page_size = page_size
        self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int32, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))
        self._offsets = torch.arange(page_size, dtype=torch.int32, device=device)

    @property
    def max_context(self) -> int:
        return self.req_to_token.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)

    def write_pages(self, row: int, first_page: int, pages: list[int]) -> None:
        """Point logical pages ``first_page ..`` of ``row`` at the physical ``pages`` (page-aligned)."""
        if not pages:
            return
        page_ids = torch.tensor(pages, dtype=torch.int32).to(self.req_to_token.device)
        slots = (page_ids[:, None] * self.page_size + self._offsets[None, :]).flatten()  # [n * P]
        start = first_page * self.page_size
        self.req_to_token[row, start : start + slots.shape[0]] = slots
