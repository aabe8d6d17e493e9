"""An OpenAI-compatible HTTP server over the engine (``portattn serve``).

``protocol`` holds the request bodies, ``async_engine`` the thread that owns the engine, ``app`` the
FastAPI routes, ``metrics`` the Prometheus metrics and ``cli`` the command. It needs the ``serve``
extra (fastapi, uvicorn, prometheus_client): ``pip install 'portattn[serve]'``.
"""

from __future__ import annotations

__all__ = ["create_app"]


def create_app(*args, **kwargs):
    from .cli import create_app

    return create_app(*args, **kwargs)
