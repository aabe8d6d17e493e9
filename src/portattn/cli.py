"""The ``portattn`` command line: ``portattn check``, ``generate``, ``serve`` and ``demo``."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portattn", description="Device-portable paged attention.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log backend choices and progress")
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

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.run(args)
    except ValueError as exc:  # bad input: the message says what was expected; no traceback needed
        if args.verbose:
            raise
        print(f"portattn {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
