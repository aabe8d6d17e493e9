"""An OpenAI-compatible HTTP server over the engine (``portattn serve``).

``protocol`` holds the request bodies and the error body, ``preprocess`` the worker thread that
renders templates and tokenizes, ``async_engine`` the thread that owns the engine, ``app`` the
FastAPI routes, ``responses`` the response bodies and event streams, ``middleware`` the API-key and
body-size checks, ``metrics`` the Prometheus metrics and the statistics line, ``lifecycle`` the port,
signals and shutdown, and ``cli`` the command. It needs the ``serve`` extra (fastapi, uvicorn,
prometheus_client): ``pip install 'portattn[serve]'``.
"""

from __future__ import annotations

__all__ = ["create_app"]


def create_app(*args, **kwargs):
    from .cli import create_app

    return create_app(*args, **kwargs)
