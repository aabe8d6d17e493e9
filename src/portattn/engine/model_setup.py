"""What a model gets under an :class:`EngineConfig`: its attention backend and its KV pool (the
engine's model and a speculative draft model alike)."""

from __future__ import annotations

from ..backends.base import Request
from ..backends.registry import select_backend
from ..kv_quant import is_quantized
from ..models import loader
from ..runtime.kv_cache import make_kv_pool
from .config import EngineConfig


def select_attention_backend(model, config: EngineConfig):
    """The attention backend for ``model`` under ``config``: one request covering every op and
    feature of its layers (design §6.2)."""
    specs = model.attention_specs()
    features = frozenset().union(*(spec.features for spec in specs))
    first, *others = model.attention_ops
    kv_dtype = config.kv_cache_dtype
    request = Request(
        first,
        config.device.type,
        config.dtype,
        specs[0].head_dim,
        features,
        frozenset(others),
        kv_dtype=kv_dtype if is_quantized(kv_dtype) else None,
    )
    return select_backend("attention", config.attention_backend, request)


def model_kv_pool(model, path: str, config: EngineConfig, num_pages: int):
    """A KV pool of ``num_pages`` pages for ``model`` (checkpoint ``path``: an fp8 cache's scales)."""
    spec = model.kv_cache_spec()
    pool = make_kv_pool(spec, num_pages, config.page_size, config.kv_cache_dtype, config.device)
    if is_quantized(config.kv_cache_dtype):
        pool.set_kv_scales(loader.kv_cache_scales(path, spec.num_layers))
    return pool
