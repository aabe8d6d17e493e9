"""One registry of attention backends, imported lazily, selected once and logged.

Selection order: an explicit name (argument or ``--attention-backend`` / ``--mm-attention-backend``
flag) > the environment variable ``PORTATTN_ATTENTION_BACKEND`` / ``PORTATTN_MM_ATTENTION_BACKEND``
> ``auto``: the highest-priority backend that imports on this device and covers the request.

Two kinds of selection exist: ``"attention"`` (paged attention and MLA decode in decoder layers)
and ``"mm"`` (varlen attention in vision encoders). Both draw on the same registry.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch

from ..errors import UnsupportedFeatureError
from .base import AttentionBackend, Request, describe

logger = logging.getLogger("portattn")

ENV_VARS = {"attention": "PORTATTN_ATTENTION_BACKEND", "mm": "PORTATTN_MM_ATTENTION_BACKEND"}


@dataclass(frozen=True)
class _Entry:
    name: str
    target: str  # "module:Class", imported on first use


_REGISTRY: dict[str, _Entry] = {}
_CLASSES: dict[str, type[AttentionBackend] | None] = {}
_INSTANCES: dict[str, AttentionBackend] = {}
_IMPORT_ERRORS: dict[str, str] = {}
_LOGGED: set[tuple[str, str, str]] = set()


def register_backend(name: str, target: str) -> None:
    """Register ``target`` (``"package.module:ClassName"``) under ``name``; imported lazily."""
    if name in _REGISTRY and _REGISTRY[name].target != target:
        raise ValueError(f"attention backend {name!r} is already registered as {_REGISTRY[name].target}")
    _REGISTRY[name] = _Entry(name, target)


def registered_backends() -> list[str]:
    return list(_REGISTRY)


def backend_targets() -> dict[str, str]:
    """Name -> ``"package.module:ClassName"`` of every registered backend, for processes that must
    know the same backends (the other tensor-parallel ranks register them again)."""
    return {name: entry.target for name, entry in _REGISTRY.items()}


def backend_class(name: str) -> type[AttentionBackend] | None:
    """The backend's class, or ``None`` when its module does not import here (e.g. no triton)."""
    if name not in _REGISTRY:
        raise ValueError(f"expected an attention backend in {[*_REGISTRY, 'auto']}, got {name!r}")
    if name not in _CLASSES:
        module_name, class_name = _REGISTRY[name].target.split(":")
        try:
            _CLASSES[name] = getattr(importlib.import_module(module_name), class_name)
        except ImportError as exc:
            _CLASSES[name] = None
            _IMPORT_ERRORS[name] = str(exc)
    return _CLASSES[name]


def available_backends(device: torch.device | str) -> list[str]:
    """Registered backends that import and run on ``device``, highest priority first."""
    device = torch.device(device)
    found = []
    for name in _REGISTRY:
        cls = backend_class(name)
        if cls is not None and cls.is_available(device):
            found.append(cls)
    return [cls.name for cls in sorted(found, key=lambda c: -c.priority)]


def _instance(name: str) -> AttentionBackend:
    if name not in _INSTANCES:
        cls = backend_class(name)
        if cls is None:
            raise ValueError(
                f"attention backend {name!r} could not be imported: {_IMPORT_ERRORS[name]} "
                f"(install it with `pip install portattn[{name}]`)"
            )
        _INSTANCES[name] = cls()
    return _INSTANCES[name]


def _supporters(kind: str, value: object, request: Request) -> list[str]:
    """Importable backends that have the missing capability (and the requested op)."""
    op = value if kind == "op" else request.op
    names = []
    for name in _REGISTRY:
        cls = backend_class(name)
        caps = None if cls is None else cls.capabilities_on(torch.device(request.device_type))
        if caps is not None and caps.supports("op", op) and caps.supports(kind, value):
            names.append(name)
    return names


def require_ops(backend: AttentionBackend, ops) -> None:
    """Raise :class:`UnsupportedFeatureError` naming the backends that have it if ``backend`` lacks one of ``ops``."""
    for op in ops:
        if not backend.capabilities.supports("op", op):
            have = [n for n in _REGISTRY if (c := backend_class(n)) and c.capabilities.supports("op", op)]
            raise UnsupportedFeatureError(f"the {op} op", backend.name, have)


def resolve_name(kind: str, name: str | None = None) -> tuple[str, str]:
    """The requested backend name and where it came from (argument, env var, or auto)."""
    if kind not in ENV_VARS:
        raise ValueError(f"expected a backend kind in {list(ENV_VARS)}, got {kind!r}")
    if name not in (None, "auto"):
        return name, "requested"
    env = os.environ.get(ENV_VARS[kind], "").strip()
    if env and env != "auto":
        return env, ENV_VARS[kind]
    return "auto", "auto"


def select_backend(kind: str, name: str | None, request: Request) -> AttentionBackend:
    """Resolve ``name`` (or the env var, or auto) to a backend that covers ``request``.

    Raises:
        UnsupportedFeatureError: the chosen backend lacks something the request needs.
        ValueError: unknown name, or a backend that does not import or run on this device.
    """
    chosen, source = resolve_name(kind, name)
    device = torch.device(request.device_type)
    if chosen == "auto":
        for candidate in available_backends(device):
            cls = backend_class(candidate)
            if cls.runs_natively(device) and request.missing(cls.capabilities_on(device)) is None:
                chosen = candidate
                break
        else:
            missing = request.missing(_instance("torch").capabilities) or ("op", request.op)
            raise UnsupportedFeatureError(describe(*missing), "auto", _supporters(*missing, request))
    backend = _instance(chosen)
    if not type(backend).is_available(device):
        raise ValueError(
            f"attention backend {chosen!r} does not run on device type {request.device_type!r}; "
            f"available here: {available_backends(device)}"
        )
    missing = request.missing(type(backend).capabilities_on(device))
    if missing is not None:
        raise UnsupportedFeatureError(describe(*missing), chosen, _supporters(*missing, request))
    key = (kind, chosen, source)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("%s backend: %s (%s)", kind, chosen, source)
    return backend


register_backend("torch", "portattn.backends.torch_ref:TorchBackend")
register_backend("triton", "portattn.backends.triton:TritonBackend")
register_backend("sdpa", "portattn.backends.sdpa:SdpaBackend")
