"""What each install extra brings, and the error that names the extra to install.

``pip install portattn`` is the op library: torch alone (``portattn[triton]`` adds the Triton
kernels). The engine (``portattn.LLM``, ``portattn generate``, ``portattn demo``) needs the
``engine`` extra, the server (``portattn serve``) the ``serve`` extra as well. Entry points that
need an extra call :func:`require_extra` before importing what needs it, so that a missing package
is one ``ImportError`` saying what to install, not a traceback from inside a model file.
"""

from __future__ import annotations

import importlib.util

# The packages an extra's entry points import (the distribution names in pyproject.toml, as modules);
# the engine's gguf is imported only when a .gguf file is loaded (models/gguf.py names it then).
EXTRAS: dict[str, tuple[str, ...]] = {
    "engine": ("transformers", "safetensors", "tqdm"),
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
}
# An extra that brings another's packages too.
INCLUDES: dict[str, tuple[str, ...]] = {"serve": ("engine",)}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses the name, or a broken entry in sys.modules
        return False


def missing_packages(extra: str) -> list[str]:
    """The packages of ``extra`` (and of the extras it includes) that are not installed."""
    if extra not in EXTRAS:
        raise ValueError(f"expected an extra in {sorted(EXTRAS)}, got {extra!r}")
    names = [m for included in INCLUDES.get(extra, ()) for m in EXTRAS[included]] + list(EXTRAS[extra])
    return [name for name in names if not _installed(name)]


def require_extra(extra: str, what: str) -> None:
    """Raise ``ImportError`` naming ``pip install 'portattn[extra]'`` if a package of ``extra`` is missing.

    ``what`` says who needs it (``"portattn.LLM"``, ``"portattn serve"``).
    """
    missing = missing_packages(extra)
    if missing:
        raise ImportError(
            f"{what} needs the {extra} extra: pip install 'portattn[{extra}]' (not installed: {', '.join(missing)})"
        )
