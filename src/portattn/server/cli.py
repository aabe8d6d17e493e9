"""``portattn serve MODEL``: load a checkpoint and serve it over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import logging

from ..engine import arguments
from ..engine.config import EngineConfig
from ..extras import require_extra
from .gc_pauses import SLOW_COLLECTION_S, freeze_start_up_objects, log_slow_collections

logger = logging.getLogger("portattn")

DEFAULT_MAX_REQUEST_BYTES = 32 << 20
DEFAULT_SHUTDOWN_TIMEOUT = 20.0  # seconds; below the 30 s a container supervisor usually waits
LOG_STATS_INTERVAL = 10.0  # seconds between statistics lines


def _count(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < 1:
            raise argparse.ArgumentTypeError(f"expected {flag} to be a positive int, got {text!r}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected --shutdown-timeout to be seconds >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every field of EngineConfig is a flag, as for `portattn generate` (one source: the dataclass);
    # the model may also come first, as `portattn serve MODEL`.
    model_help = next(f for f in dataclasses.fields(EngineConfig) if f.name == "model").metadata["help"]
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help=f"{model_help} (or --model)")
    engine = parser.add_argument_group("engine (portattn.LLM keywords)")
    engine.add_argument("--model", default=None, help=model_help)
    arguments.add_flags(engine, EngineConfig, exclude=("model",))
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    server.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 path")
    server.add_argument(
        "--max-queue",
        type=_count("--max-queue"),
        default=None,
        help="answer 503 while this many requests wait (default: no limit)",
    )
    server.add_argument(
        "--max-request-bytes",
        type=_count("--max-request-bytes"),
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"refuse request bodies over this many bytes with 413 (default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (default: only the model's template is rendered)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGINT/SIGTERM, seconds the requests in flight get to finish before they are ended "
        f"(default: {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help=f"no statistics line (throughput, queue, KV cache) every {LOG_STATS_INTERVAL:g} s at INFO",
    )
    server.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level (default: warning)")
    server.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine in a process of its own, apart from the HTTP event loop (text models; default: "
        "on a GPU for a text model, else on a thread of the server's process)",
    )


def engine_args(args: argparse.Namespace) -> dict:
    """The engine keywords of the command line; the model positional or from ``--model``."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"expected one model, got MODEL {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag if args.model_tag is not None else args.model
    if model is None:
        raise ValueError("expected a model: portattn serve MODEL (a checkpoint directory), got none")
    return {**arguments.given(args, EngineConfig), "model": model}


def create_app(
    model: str,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    trust_request_chat_template: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    log_stats_interval: float | None = LOG_STATS_INTERVAL,
    engine_process: bool | None = False,
    **engine_args,
):
    """Load the checkpoint and return the FastAPI app serving it (the engine thread starts with the
    app). ``log_stats_interval``: seconds between statistics lines at INFO (None: none). ``engine_process``:
    the engine built and stepped in a process of its own (``server/engine_process.py``; text models); None:
    where :func:`engine_process_default` says (``portattn serve``'s default)."""
    require_extra("serve", "portattn serve")
    from ..engine.build import build_engine
    from ..engine.input_processor import InputProcessor
    from ..models import loader
    from .app import Server, build_app
    from .async_engine import AsyncEngine
    from .preprocess import Preprocessor

    for name, value in (("max_queue", max_queue), ("max_request_bytes", max_request_bytes)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"expected {name} to be None or a positive int, got {value!r}")
    if log_stats_interval is not None and not log_stats_interval > 0:
        raise ValueError(f"expected log_stats_interval to be None or seconds > 0, got {log_stats_interval!r}")
    arguments.check_keywords(EngineConfig, engine_args, what="create_app")
    config = EngineConfig(model=model, **engine_args)
    if engine_process is None:  # (the default's checks include refuse_multimodal's)
        engine_process, why = engine_process_default(config)
        logger.info("engine: %s (%s)", "in a process of its own" if engine_process else "on a thread", why)
    elif engine_process:
        from .engine_process import refuse_multimodal

        refuse_multimodal(config)
    if engine_process:
        from .engine_process import EngineProcess

        async_engine = EngineProcess(config, max_queue=max_queue)
        engine = async_engine.engine
    else:
        engine = build_engine(config)
    # The handlers tokenize with a tokenizer of their own: the engine thread decodes with the engine's.
    tokenizer = loader.load_tokenizer(engine.config.tokenizer or engine.config.model)
    processor = InputProcessor(engine.model, tokenizer, engine.config.model)
    if engine_process:
        engine.tokenizer = tokenizer
    else:
        async_engine = AsyncEngine(engine, max_queue=max_queue)
    server = Server(
        async_engine,
        Preprocessor(processor, engine),
        served_model_name or str(model),
        api_key,
        trust_request_chat_template=trust_request_chat_template,
        max_request_bytes=max_request_bytes,
        log_stats_interval=log_stats_interval,
    )
    return build_app(server)


def engine_process_default(config: EngineConfig) -> tuple[bool, str]:
    """Whether ``portattn serve`` runs the engine in a process of its own when not told, and why: on a GPU
    for a text model (there the steps are short and the event loop's work on the same GIL delayed them: ITL
    p99 1.7-2.4x the median against 2.4-2.9x on a thread, H200, Poisson 16, round 29). Not on a CPU, where the
    engine's threads and the server's share the few cores; not for a model that takes images, whose inputs
    the model's own code builds in the server's process (``engine_process.refuse_multimodal``); not where a
    model or attention backend is registered in ``__main__``, which another process cannot import."""
    from ..engine.parallel.driver import registrations
    from .engine_process import refuse_multimodal

    if config.device.type == "cpu":
        return False, "on a CPU; --engine-process to run it in a process of its own"
    try:
        registrations("--engine-process")
    except ValueError:
        return False, "a model or attention backend registered in __main__, which another process cannot import"
    try:
        refuse_multimodal(config)
    except ValueError:
        return False, "the model takes images: served with the engine on a thread"
    return True, "the default on a GPU for a text model; --no-engine-process keeps it on a thread"


def main(args: argparse.Namespace) -> int:
    require_extra("serve", "portattn serve")
    import torch

    from .lifecycle import bind_socket, cpu_threads, serve

    kwargs = engine_args(args)
    threads, why = cpu_threads()  # read now: a bad OMP_NUM_THREADS fails before the model loads
    portattn_logger = logging.getLogger("portattn")
    if portattn_logger.getEffectiveLevel() > logging.INFO:  # the start-up lines and statistics, as vLLM shows
        portattn_logger.setLevel(logging.INFO)
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails now
    try:
        app = create_app(
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_queue=args.max_queue,
            trust_request_chat_template=args.trust_request_chat_template,
            max_request_bytes=args.max_request_bytes,
            log_stats_interval=None if args.disable_log_stats else LOG_STATS_INTERVAL,
            engine_process=args.engine_process,
            **kwargs,
        )
    except BaseException:
        sock.close()
        raise
    server = app.state.server
    if server.engine.engine.config.device.type == "cpu":
        torch.set_num_threads(threads)
        logger.info("CPU: intra-op threads: %d (%s)", threads, why)
    freeze_start_up_objects()
    log_slow_collections(SLOW_COLLECTION_S)
    loop_factory, loop_name = event_loop()
    logger.info(
        "serving %s on http://%s:%d (event loop: %s; HTTP: %s)",
        server.model_name,
        args.host,
        args.port,
        loop_name,
        http_parser(),
    )
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(app, sock, shutdown_timeout=args.shutdown_timeout, log_level=args.uvicorn_log_level))
    logger.info("stopped")
    return 1 if server.engine.error is not None else 0  # a supervisor restarts a server that failed


def event_loop():
    """The event loop ``portattn serve`` runs on: uvloop's where it is installed (``pip install
    portattn[serve]`` brings it on Linux and macOS), else asyncio's; as uvicorn's ``loop="auto"`` picks.
    Every streamed token is a few callbacks on the loop, which shares the GIL with the engine's thread:
    a faster loop leaves the engine more of it. Returns ``(loop_factory or None, its name)``."""
    try:
        import uvloop
    except ImportError:
        return None, "asyncio"
    return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"


def http_parser() -> str:
    """The HTTP implementation uvicorn's ``http="auto"`` takes: httptools where installed, else h11."""
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


def uvicorn_server(app, **config):
    """A ``uvicorn.Server`` for ``app`` (``config``: ``uvicorn.Config``'s keywords) that exits when
    the engine dies (``app.state.exit_server``, see :func:`portattn.server.app.build_app`), for an
    application that runs the server itself (``portattn serve`` runs :func:`lifecycle.serve`)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, **config))
    app.state.exit_server = lambda: setattr(server, "should_exit", True)
    return server
