"""``portattn serve``: load a checkpoint and serve it over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import logging

from ..engine import arguments
from ..engine.config import EngineConfig

logger = logging.getLogger("portattn")

_MISSING = "portattn serve needs fastapi, uvicorn and prometheus_client: pip install 'portattn[serve]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every field of EngineConfig is a flag, as for `portattn generate` (one source: the dataclass).
    arguments.add_flags(parser.add_argument_group("engine (portattn.LLM keywords)"), EngineConfig)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    server.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    server.add_argument(
        "--max-queue", type=int, default=None, help="answer 503 while this many requests wait (default: no limit)"
    )
    server.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level (default: warning)")


def create_app(
    model: str,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    **engine_args,
):
    """Load the checkpoint and return the FastAPI app serving it (the engine thread starts with the app)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as err:
        raise ImportError(_MISSING) from err
    from ..engine.build import build_engine
    from ..engine.input_processor import InputProcessor
    from ..models import loader
    from .app import Server, build_app
    from .async_engine import AsyncEngine

    if max_queue is not None and (not isinstance(max_queue, int) or max_queue < 0):
        raise ValueError(f"expected max_queue to be None or an int >= 0, got {max_queue!r}")
    arguments.check_keywords(EngineConfig, engine_args, what="create_app")
    engine = build_engine(EngineConfig(model=model, **engine_args))
    # The handlers tokenize with a tokenizer of their own: the engine thread decodes with the engine's.
    processor = InputProcessor(engine.model, loader.load_tokenizer(engine.config.model), engine.config.model)
    async_engine = AsyncEngine(engine, max_queue=max_queue)
    server = Server(async_engine, processor, served_model_name or str(model), api_key)
    return build_app(server)


def main(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ImportError(_MISSING) from err
    app = create_app(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        **arguments.given(args, EngineConfig),
    )
    logger.warning("serving %s on http://%s:%d", app.state.server.model_name, args.host, args.port)
    uvicorn_server(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level).run()
    return 1 if app.state.server.engine.error is not None else 0  # a supervisor restarts a server that failed


def uvicorn_server(app, **config):
    """A ``uvicorn.Server`` for ``app`` (``config``: ``uvicorn.Config``'s keywords) that exits when
    the engine dies (``app.state.exit_server``, see :func:`portattn.server.app.build_app`)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, **config))
    app.state.exit_server = lambda: setattr(server, "should_exit", True)
    return server
