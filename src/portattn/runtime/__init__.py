"""The floor under models and the engine: what a forward reads besides its tokens.

``kv_cache``: what a model caches per token (:class:`KVCacheSpec`) and the pools that hold it, one
table of kinds (``"mha"``, ``"mla"``), each pool class bringing its kind's plans; ``context``: the
:class:`ForwardContext` a model's layers read; ``multimodal``: the images of a request and of one
forward; ``plan``: the plans of the ``"mla"`` kind (per forward and for captured steps). Nothing here
imports ``portattn.models`` or ``portattn.engine``.
"""

from .context import ForwardContext
from .kv_cache import KVCacheSpec, KVPool, MHAKVPool, MLAKVPool, make_kv_pool, mla_cache_spec

__all__ = ["ForwardContext", "KVCacheSpec", "KVPool", "MHAKVPool", "MLAKVPool", "make_kv_pool", "mla_cache_spec"]
