"""Graph-replay timings of ``scripts/ncu_mla.py`` cases, one a line: ``python3 scripts/mla_times.py CASES [SECONDS]``.

A case is ``ncu_mla.py``'s arguments (``--time`` is added) after any number of settings ``module.NAME=value``: the
attribute ``NAME`` of ``portattn.kernels.triton.<module>`` set to the Python literal ``value`` for that case and
set back after it, for example::

    mla_decode_wide_fp8.SEESAW_VREGS=True e4m3 --heads 64 --fp8-scores --fp8-values --seesaw
    mla_decode_launch.WIDE_FP8_VALUES=False e4m3 --heads 64 --fp8-scores

Empty lines and lines starting with ``#`` are skipped. Cases that would start past ``SECONDS`` (default: no limit)
are listed as not run, and a case that fails is reported while the rest run: one file of cases makes one GPU call.
"""

from __future__ import annotations

import ast
import importlib
import shlex
import sys
import time
from contextlib import contextmanager

PACKAGE = "portattn.kernels.triton"


def parse_case(line: str) -> tuple[list[tuple[str, str, object]], list[str]]:
    """``(settings, arguments)`` of a case: each leading ``module.NAME=value`` as ``(module, NAME, value)`` (the
    value a Python literal), then ``ncu_mla.py``'s arguments."""
    words = shlex.split(line)
    settings = []
    while words and "=" in words[0] and not words[0].startswith("-"):
        target, _, text = words.pop(0).partition("=")
        module, dot, name = target.rpartition(".")
        if not dot or not module or not name:
            raise ValueError(f"expected a setting module.NAME=value, got {target}={text}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"expected a Python literal for {target}, got {text!r}") from exc
        settings.append((module, name, value))
    return settings, words


def switches() -> list[tuple[object, str, object]]:
    """Every upper-case setting (a bool, number, string or None) of the loaded modules of ``portattn.kernels.triton``
    with its value: what a case may change, ``ncu_mla.py``'s own options included."""
    found = []
    for key, mod in list(sys.modules.items()):
        if key.startswith(PACKAGE + ".") and mod is not None:
            for name, value in vars(mod).items():
                if name.isupper() and (value is None or isinstance(value, (bool, int, float, str))):
                    found.append((mod, name, value))
    return found


@contextmanager
def applied(settings: list[tuple[str, str, object]]):
    """The settings applied to the modules of ``portattn.kernels.triton`` inside the block; after it every setting
    of those modules is as before (:func:`switches`: also those that ``ncu_mla.py``'s options set). An unknown module
    or attribute is refused before any is set."""
    targets = []
    for module, name, value in settings:
        mod = importlib.import_module(f"{PACKAGE}.{module}")
        if not hasattr(mod, name):
            raise ValueError(f"expected an attribute of {PACKAGE}.{module}, got {name}")
        targets.append((mod, name, value))
    before = switches() + [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    try:
        for mod, name, value in targets:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in reversed(before):
            setattr(mod, name, value)


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__.split("\n\n")[0])
    sys.path.insert(0, "scripts")
    import ncu_mla
    import torch

    importlib.import_module(f"{PACKAGE}.mla_decode_wide_fp8")  # its switches, which ncu_mla.py's options set, kept

    with open(sys.argv[1]) as f:
        cases = [line for line in f.read().splitlines() if line.strip() and not line.startswith("#")]
    limit = float(sys.argv[2]) if len(sys.argv) == 3 else float("inf")
    start = time.monotonic()
    for line in cases:
        if time.monotonic() - start > limit:
            print(f"{line}: not run (past {limit:.0f} s)", flush=True)
            continue
        try:
            settings, words = parse_case(line)
            print("".join(f"{m}.{n}={v!r} " for m, n, v in settings), end="")
            with applied(settings):
                sys.argv = ["ncu_mla.py", *words, "--time"]
                ncu_mla.main()
        except Exception as exc:  # one case's failure is reported and the rest run
            print(f"{line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        sys.stdout.flush()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
