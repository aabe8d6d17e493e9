"""``portattn serve`` takes every engine flag, from the same dataclass as ``portattn generate``."""

from __future__ import annotations

import argparse
import logging

import pytest

from portattn.engine import arguments
from portattn.engine.cli import add_arguments as add_generate_arguments
from portattn.engine.config import EngineConfig
from portattn.server.cli import add_arguments, engine_args


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
    assert engine_args(args) == {"model": "m", "page_size": 7, "enable_prefix_caching": True}
    assert (args.max_queue, args.port, args.host) == (3, 8000, "127.0.0.1")


def test_serve_takes_the_model_positionally():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_args(parser.parse_args(["ckpt", "--page-size", "8"])) == {"model": "ckpt", "page_size": 8}
    assert engine_args(parser.parse_args(["--model", "ckpt"])) == {"model": "ckpt"}
    assert engine_args(parser.parse_args(["ckpt", "--model", "ckpt"])) == {"model": "ckpt"}
    with pytest.raises(ValueError, match="expected one model, got MODEL 'a' and --model 'b'"):
        engine_args(parser.parse_args(["a", "--model", "b"]))
    with pytest.raises(ValueError, match="expected a model"):
        engine_args(parser.parse_args([]))
    args = parser.parse_args(["ckpt"])
    assert (args.shutdown_timeout, args.max_request_bytes, args.disable_log_stats) == (20.0, 32 << 20, False)
    assert not args.trust_request_chat_template
    for flag, value in (("--max-queue", "0"), ("--max-request-bytes", "-1"), ("--shutdown-timeout", "-2")):
        with pytest.raises(SystemExit):
            parser.parse_args(["ckpt", flag, value])


def test_serve_freezes_what_the_start_up_left_after_collecting_its_garbage(monkeypatch):
    """``portattn serve`` (main) calls ``freeze_start_up_objects`` once the app is built and before it serves;
    that collects the garbage there is (a dropped cycle is freed, not frozen) and freezes what is alive."""
    import gc
    import weakref

    from portattn.server import cli

    class Node:
        pass

    kept, dropped = Node(), Node()
    kept.me, dropped.me = kept, dropped  # two cycles
    dead = weakref.ref(dropped)
    del dropped
    gc.disable()  # no automatic collection between here and the call
    try:
        cli.freeze_start_up_objects()
        assert dead() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
    order = []
    monkeypatch.setattr(cli, "require_extra", lambda *a: None)
    monkeypatch.setattr(cli, "create_app", lambda **kw: order.append("app") or _App())
    monkeypatch.setattr(cli, "freeze_start_up_objects", lambda: order.append("freeze"))
    monkeypatch.setattr(cli, "log_slow_collections", lambda threshold_s: order.append(("gc log", threshold_s)))
    monkeypatch.setattr(cli.asyncio, "Runner", _Runner.recording(order))
    import portattn.server.lifecycle as lifecycle

    monkeypatch.setattr(lifecycle, "bind_socket", lambda host, port: None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert cli.main(parser.parse_args(["--model", "m"])) == 0
    assert order == ["app", "freeze", ("gc log", cli.SLOW_COLLECTION_S), "serve"]


def test_a_slow_garbage_collection_is_logged_with_its_generation_and_time(caplog):
    """The serve process's collections at or over the threshold are logged (a zero threshold logs every one);
    under it, none; the callback is gc's until removed."""
    import gc

    from portattn.server import cli

    callback = cli.log_slow_collections(0.0)
    try:
        with caplog.at_level(logging.WARNING, logger="portattn"):
            gc.collect(2)
        lines = [r.getMessage() for r in caplog.records if "garbage collection" in r.getMessage()]
        assert any(line.startswith("garbage collection of generation 2 took ") for line in lines), lines
    finally:
        gc.callbacks.remove(callback)
    callback = cli.log_slow_collections(3600.0)
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="portattn"):
            gc.collect(2)
        assert not [r for r in caplog.records if "garbage collection" in r.getMessage()]
    finally:
        gc.callbacks.remove(callback)


class _Runner:
    """asyncio.Runner's part that main uses: records "serve" for the coroutine it is given (closed unrun)."""

    @classmethod
    def recording(cls, order):
        return lambda loop_factory=None: cls(order)

    def __init__(self, order):
        self.order = order

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, coroutine):
        coroutine.close()
        self.order.append("serve")


class _App:
    """What ``main`` reads of an app: the server's name, its engine's device and error."""

    def __init__(self):
        import torch

        engine = argparse.Namespace(config=argparse.Namespace(device=torch.device("cuda")))
        server = argparse.Namespace(model_name="m", engine=argparse.Namespace(engine=engine, error=None))
        self.state = argparse.Namespace(server=server)


def test_serve_runs_on_uvloop_where_installed_else_on_asyncio(monkeypatch):
    """``event_loop`` gives uvloop's loop factory when uvloop imports, and asyncio's default (None) when not."""
    import sys
    import types

    from portattn.server import cli

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails
    assert cli.event_loop() == (None, "asyncio")
    stand_in = types.ModuleType("uvloop")
    stand_in.__version__ = "9.9"
    stand_in.new_event_loop = object()
    monkeypatch.setitem(sys.modules, "uvloop", stand_in)
    assert cli.event_loop() == (stand_in.new_event_loop, "uvloop 9.9")
    assert cli.http_parser() in {"httptools", "h11"}
