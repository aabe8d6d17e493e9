"""The ``portattn`` command line: ``portattn check``, ``generate``, ``serve`` and ``demo``.

Every error is one line on standard error, ``portattn COMMAND: error: ...`` naming the flag or
file at fault, with exit status 2; ``-v`` (before or after the command) also shows the traceback.

``check``, ``generate`` and ``serve`` take ``--register`` (repeatable), run before the command:
``MODULE[:FUNC]`` imports ``MODULE`` and calls ``FUNC()`` if given (the module or the function
registers models with ``portattn.models.register_model`` or attention backends with
``portattn.backends.registry.register_backend``); ``NAME=MODULE:CLASS`` registers the attention
backend class ``CLASS`` under ``NAME``. The module must be importable (installed, or on
``PYTHONPATH``); tensor-parallel ranks register again what was registered (not the flags).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ._version import __version__

REGISTER_HELP = (
    "MODULE[:FUNC] to import (and FUNC to call) before the command, to register models or attention "
    "backends, or NAME=MODULE:CLASS to register an attention backend class (repeatable)"
)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (argparse prints the usage too): the line names the flag."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def _verbose_flag(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logs; tracebacks")


def register(specs: list[str]) -> dict[str, str]:
    """Run ``--register`` flags (see the module's docstring), each checked now so that an error is one
    line naming the flag; returns attention backend name -> the flag that registered it."""
    from .backends.registry import registered_backends

    done = {}
    for spec in specs:
        before = set(registered_backends())
        if "=" in spec:
            _register_backend_class(spec)
        else:
            _run_plugin(spec)
        done |= {name: spec for name in registered_backends() if name not in before}
    return done


def _import(spec: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--register {spec}: cannot import {module_name} ({exc})") from None


def _run_plugin(spec: str) -> None:
    module_name, _, func_name = spec.partition(":")
    if not module_name or (":" in spec and not func_name):
        raise ValueError(f"expected --register MODULE[:FUNC] or NAME=MODULE:CLASS, got {spec!r}")
    module = _import(spec, module_name)
    if func_name:
        func = getattr(module, func_name, None)
        if not callable(func):
            raise ValueError(f"expected --register {spec}: a function {func_name} in {module_name}, got {func!r}")
        func()


def _register_backend_class(spec: str) -> None:
    from .backends.base import AttentionBackend
    from .backends.registry import register_backend

    name, _, target = spec.partition("=")
    module_name, _, class_name = target.partition(":")
    if not (name and module_name and class_name):
        raise ValueError(f"expected --register NAME=module:Class, got {spec!r}")
    cls = getattr(_import(spec, module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise ValueError(f"expected --register {spec}: an AttentionBackend, got {cls!r}")
    if getattr(cls, "name", None) != name:
        raise ValueError(f"expected --register {spec}: {class_name}.name == {name!r}, got {cls.name!r}")
    register_backend(name, target)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, (ValueError, TypeError, OSError)):  # bad input: the message says what was expected
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text} (-v shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="portattn", description="Device-portable paged attention.")
    parser.add_argument("--version", action="version", version=f"portattn {__version__}")
    _verbose_flag(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)

    from . import check

    check_parser = sub.add_parser("check", help="check every backend on this device against float64")
    check.add_arguments(check_parser)
    check_parser.set_defaults(run=check.main)

    from . import demo
    from .engine import cli as engine_cli

    generate_parser = sub.add_parser("generate", help="generate from a Hugging Face checkpoint directory")
    engine_cli.add_arguments(generate_parser)
    generate_parser.set_defaults(run=engine_cli.main)

    from .server import cli as serve_cli

    serve_parser = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    serve_cli.add_arguments(serve_parser)
    serve_parser.set_defaults(run=serve_cli.main)

    demo_parser = sub.add_parser(
        "demo", help="tiny random checkpoints of each family through the engine, checked against transformers"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main)
    for subparser in (check_parser, generate_parser, serve_parser, demo_parser):
        _verbose_flag(subparser, argparse.SUPPRESS)  # -v after the command; absent: the top level's value
    for subparser in (check_parser, generate_parser, serve_parser):
        subparser.add_argument("--register", action="append", default=[], metavar="SPEC", help=REGISTER_HELP)

    args = parser.parse_args(argv)
    # The engine's INFO lines (device, dtype, KV cache, backends) show by default, as vLLM's do; check
    # and demo print tables of their own and log warnings only. -v adds debug lines and tracebacks.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    default = logging.WARNING if args.command in ("check", "demo") else logging.INFO
    logging.getLogger("portattn").setLevel(logging.DEBUG if args.verbose else default)
    try:
        args.registered = register(getattr(args, "register", []))
        return args.run(args)
    except KeyboardInterrupt:
        if args.verbose:
            raise
        print(f"portattn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`portattn check | head`): stop quietly, as other command-line tools do, with
        # the status of a process ended by SIGPIPE. Standard output goes nowhere from here on, so that
        # the interpreter's last flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except Exception as exc:
        if args.verbose:
            raise
        print(f"portattn {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
