"""``portattn serve`` takes every engine flag, from the same dataclass as ``portattn generate``."""

from __future__ import annotations

import argparse

from portattn.engine import arguments
from portattn.engine.cli import add_arguments as add_generate_arguments
from portattn.engine.config import EngineConfig
from portattn.server.cli import add_arguments


def options(add) -> set[str]:
    parser = argparse.ArgumentParser()
    add(parser)
    return {s for action in parser._actions for s in action.option_strings}


def test_serve_takes_every_engine_flag():
    engine_flags = {"--" + name.replace("_", "-") for name in arguments.names(EngineConfig)}
    serve = options(add_arguments)
    assert engine_flags <= serve and engine_flags <= options(add_generate_arguments)
    assert {"--host", "--port", "--served-model-name", "--api-key", "--max-queue"} <= serve
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--page-size", "7", "--enable-prefix-caching", "--max-queue", "3"])
    assert arguments.given(args, EngineConfig) == {"model": "m", "page_size": 7, "enable_prefix_caching": True}
    assert (args.max_queue, args.port, args.host) == (3, 8000, "127.0.0.1")
