"""The MLA latent KV pool: one latent cache per layer, ``[num_pages, P, kv_lora_rank + rope_dim]``.

Each row is one token's ``[c_kv | k_pe]`` (the normalised KV latent and the rotated rope key),
shared by every query head -- the layout :func:`portattn.mla_decode` reads. Pages, ``req_to_token``
and prefix caching are the engine's own: only what a slot holds differs from the ``"mha"`` pool.
Importing this module registers the pool under the kind ``"mla"``.
"""

from __future__ import annotations

import torch

from .kv_pool import KVCacheSpec, KVPool, register_kv_pool

MLA_KIND = "mla"


def mla_cache_spec(num_layers: int, kv_lora_rank: int, rope_dim: int) -> KVCacheSpec:
    """A spec for ``num_layers`` latent caches with rows of ``kv_lora_rank + rope_dim``.

    One latent "head" per token (``num_kv_heads = 1``, ``head_dim`` = the row width); there are
    no separate values (``v_head_dim = 0``): the values are the ``c_kv`` part of the row.
    """
    for name, value in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    return KVCacheSpec(num_layers, 1, kv_lora_rank + rope_dim, 0, kind=MLA_KIND)


class MLAKVPool(KVPool):
    """Per-layer latent caches ``[num_pages, P, kv_lora_rank + rope_dim]``.

    Allocated with ``torch.empty``: a slot is only read after its token's row was written.
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        if spec.num_kv_heads != 1 or spec.v_head_dim != 0:
            raise ValueError(
                f"expected an MLA spec with one latent head and no separate values (mla_cache_spec), "
                f"got num_kv_heads={spec.num_kv_heads}, v_head_dim={spec.v_head_dim}"
            )
        super().__init__(spec, num_pages, page_size, dtype, device)
        shape = (num_pages, page_size, spec.head_dim)
        self.latent = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]

    @staticmethod
    def bytes_per_page(spec: KVCacheSpec, page_size: int, dtype: torch.dtype) -> int:
        return spec.num_layers * page_size * spec.head_dim * dtype.itemsize

    def kv_cache(self, layer_id: int) -> torch.Tensor:
        return self.latent[layer_id]


register_kv_pool(MLA_KIND, MLAKVPool)
