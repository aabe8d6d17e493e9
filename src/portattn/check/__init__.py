"""``portattn check``: every backend on this device against the float64 reference.

Runs a grid of cases (op x feature x page size x dtype) for each registered backend that runs here:
mixed batches of decodes, extends and prefills, head dims 64 to 256, the masks, sinks, softcap,
ALiBi and LSE, long decodes that take the split-KV path and its merge, fp8 KV caches, MLA decode,
varlen attention and the merging of attention states. Each row is one (op, feature, backend, dtype),
its error the worst over the page sizes; a case the backend declares unsupported is skipped (listed
with the reason, and counted). A failing row names the exact case and prints a command that reruns
only it. The header names the device, driver, torch and triton; ``--json`` writes all of it as one
JSON document. Exit status 1 on any failure, when no case ran, or when a feature named by
``--require`` has no passing case. docs/check.md describes the output and how to check a new backend.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import time
from collections.abc import Iterator

import torch

from .._version import __version__
from ..backends.registry import available_backends, backend_class, registered_backends
from ..device import default_device, describe_device, is_triton_interpreter, resolve_device
from ..errors import UnsupportedFeatureError, expect
from .cases import (
    CASE_NAMES,
    CONTIGUOUS_LAYOUT,
    DTYPES,
    FEATURES,
    PAGE_SIZES,
    REQUIREMENTS,
    Feature,
    case_tags,
    describe_case,
    run_case,
)


def repro_command(
    device, backend: str, dtype_name: str, page_size: int, feature: Feature, register: str | None = None
) -> str:
    """One shell line that reruns one case; ``register``: the ``--register`` flag that registered the backend."""
    emulated = is_triton_interpreter() and not backend_class(backend).runs_natively(torch.device(device))
    env = "TRITON_INTERPRET=1 " if emulated else ""  # a Triton backend on the CPU runs only interpreted
    flag = f"--register {shlex.quote(register)} " if register else ""
    return (
        f"{env}portattn check {flag}--device {device} --backend {backend} --dtype {dtype_name} "
        f"--page-size {page_size} --case {shlex.quote(feature.name)}"
    )


def run_check(
    device: torch.device,
    backends: list[str],
    dtypes: list[str],
    page_sizes: tuple[int, ...],
    features: list[Feature] = FEATURES,
    skipped: list[dict] | None = None,
    registered: dict[str, str] | None = None,
    *,
    yield_skipped: bool = False,
) -> Iterator[dict]:
    """One row per (feature, backend, dtype) the backend supports, as soon as it is measured.

    A case the backend declares unsupported is left out (appended to ``skipped`` with the reason,
    and yielded too with ``yield_skipped``, as a row whose ``skipped`` holds the reason and that has
    no ``ok``); an exception in a case makes its row fail with the exception named. ``registered``:
    backends added by ``--register`` (name -> the flag), repeated in the rerun commands.
    """
    for feature in features:
        for backend in backends:
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                sizes = page_sizes if feature.op in ("paged_attention", "mla_decode") else CONTIGUOUS_LAYOUT
                per_size, error, unsupported = [], None, None
                for size in sizes:
                    try:
                        pairs = run_case(feature, backend, dtype, size, device)
                    except UnsupportedFeatureError as exc:
                        unsupported = str(exc)
                        break
                    except Exception as exc:  # a crash is a failure of this case, not of the whole check
                        error = f"{type(exc).__name__}: {exc}"
                        pairs = [(math.inf, 0.0)]
                    err, tol = max(pairs, key=lambda p: p[0] / max(p[1], 1e-30) if math.isfinite(p[0]) else math.inf)
                    per_size.append({"page_size": size, "max_error": err, "tolerance": tol, "ok": err <= tol})
                    if error:
                        break
                if unsupported is not None:
                    entry = dict(op=feature.op, feature=feature.name, backend=backend, dtype=dtype_name)
                    if skipped is not None:
                        skipped.append(entry | {"reason": unsupported})
                    if yield_skipped:
                        yield entry | {"skipped": unsupported}
                    continue
                worst = max(per_size, key=_badness)
                row = dict(
                    op=feature.op,
                    feature=feature.name,
                    backend=backend,
                    dtype=dtype_name,
                    max_error=worst["max_error"],
                    tolerance=worst["tolerance"],
                    ok=all(r["ok"] for r in per_size),
                    page_sizes=per_size,
                )
                if not row["ok"]:
                    failed = max((r for r in per_size if not r["ok"]), key=_badness)  # the worst: rerun shows it
                    row["case"] = describe_case(feature, dtype_name, failed["page_size"], device)
                    flag = (registered or {}).get(backend)
                    row["repro"] = repro_command(device, backend, dtype_name, failed["page_size"], feature, flag)
                    if error:
                        row["error"] = error
                yield row


def _badness(result: dict) -> float:
    return result["max_error"] / max(result["tolerance"], 1e-30)


def environment(device: torch.device, backends: list[str], dtypes: list[str], page_sizes) -> dict:
    """The header: what ran the check (device, driver, versions) and what it covers."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {
        "portattn": __version__,
        **describe_device(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "triton_interpret": is_triton_interpreter(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backends": backends,
        "dtypes": dtypes,
        "page_sizes": list(page_sizes),
    }


def format_header(env: dict) -> list[str]:
    interp = " (TRITON_INTERPRET=1)" if env["triton_interpret"] else ""
    return [
        f"portattn check {env['portattn']} on {env['device']}: {env['name']} ({env['arch']}, {env['memory']})",
        f"driver {env['driver']}, runtime {env['runtime']}, torch {env['torch']}, triton {env['triton']}{interp}, "
        f"python {env['python']}, {env['platform']}",
        f"backends {env['backends']}, dtypes {env['dtypes']}, page sizes {env['page_sizes']}",
    ]


HEADER = f"{'op':<22} {'feature':<26} {'backend':<8} {'dtype':<5} {'max error':>10} {'tolerance':>10}  result"


def format_row(r: dict) -> str:
    if "skipped" in r:  # the backend's own words say what it lacks
        reason = r["skipped"].split(";")[0].removeprefix(f"attention backend {r['backend']!r} ")
        row = f"{r['op']:<22} {r['feature']:<26} {r['backend']:<8} {r['dtype']:<5} {'-':>10} {'-':>10}"
        return f"{row}  skip ({reason})"
    line = (
        f"{r['op']:<22} {r['feature']:<26} {r['backend']:<8} {r['dtype']:<5} "
        f"{r['max_error']:>10.2e} {r['tolerance']:>10.2e}  {'pass' if r['ok'] else 'FAIL'}"
    )
    if r["ok"]:
        return line
    case = r["case"]
    details = ", ".join(f"{k} {v}" for k, v in case.items() if k not in ("op", "kwargs") and v is not None)
    details += "".join(f", {k}={v}" for k, v in case["kwargs"].items())
    lines = [line, f"    case: {details}"]
    if "error" in r:
        lines.append(f"    error: {r['error']}")
    lines.append(f"    repro: {r['repro']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device to check (default: the accelerator, else cpu)")
    parser.add_argument(
        "--backend",
        action="append",
        default=None,
        help="backend to check (repeatable; default: every backend that runs on the device)",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=list(DTYPES),
        default=None,
        help="dtype to check (repeatable; default: all that the device computes correctly)",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        action="append",
        default=None,
        help=f"page size to check (repeatable; default: {' '.join(map(str, PAGE_SIZES))})",
    )
    parser.add_argument("--case", action="append", default=None, help="run only this case (repeatable; see --list)")
    parser.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="FEATURES",
        help="exit 1 unless each of these has a passing case (comma-separated, repeatable): ops, features and "
        f"fp8 caches, of {', '.join(REQUIREMENTS)}",
    )
    parser.add_argument("--list", action="store_true", help="print the case names and what each exercises, and exit")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the header and every row as JSON to PATH (no PATH: to stdout, instead of the table)",
    )


def main(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(f"{f.op:<22} {f.name:<26} {' '.join(sorted(case_tags(f)))}" for f in FEATURES))
        return 0
    required = [name.strip() for names in args.require for name in names.split(",") if name.strip()]
    for name in required:
        expect(name in REQUIREMENTS, f"--require of {REQUIREMENTS}", repr(name))
    registered = args.registered  # backend name -> the --register flag that registered it
    try:
        device = resolve_device(args.device) if args.device else default_device()
    except ValueError as exc:
        raise ValueError(f"--device: {exc}") from None
    here = available_backends(device)
    for name in args.backend or ():
        expect(name in registered_backends(), f"--backend in {registered_backends()}", repr(name))
        expect(name in here, f"--backend that runs on {device} (here: {here})", repr(name))
    backends = args.backend or here
    dtypes = args.dtype or list(DTYPES)
    if args.dtype is None and is_triton_interpreter():
        # Triton's CPU interpreter computes bf16 dot products wrongly; check bf16 on a GPU.
        dtypes = [d for d in dtypes if d != "bf16"]
    page_sizes = tuple(args.page_size or PAGE_SIZES)
    for size in page_sizes:
        expect(size >= 1, "--page-size >= 1", size)
    for name in args.case or ():
        expect(name in CASE_NAMES, f"--case in {CASE_NAMES}", repr(name))
    features = [f for f in FEATURES if args.case is None or f.name in args.case]
    env = environment(device, backends, dtypes, page_sizes)
    table = args.json != "-"  # JSON to stdout replaces the table
    if table:
        print("\n".join(format_header(env)))
        print(HEADER)
        print("-" * len(HEADER), flush=True)
    rows, skipped = [], []
    start = time.perf_counter()
    for row in run_check(device, backends, dtypes, page_sizes, features, None, registered, yield_skipped=True):
        (skipped if "skipped" in row else rows).append(row)
        if table:
            print(format_row(row), flush=True)  # rows stream: Triton compiles a kernel per new shape
    summary = summarize(rows, skipped, required, time.perf_counter() - start)
    if args.json is not None:
        doc = json.dumps(jsonable({"environment": env, "rows": rows, "skipped": skipped, "summary": summary}), indent=1)
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w") as f:
                f.write(doc + "\n")
    if table:
        print("\n".join(summary_lines(summary)))
    return 0 if summary["ok"] else 1


def summarize(rows: list[dict], skipped: list[dict], required: list[str], seconds: float) -> dict:
    """Counts and the verdict: ok when some case ran, none failed, and each required feature passed."""
    features = {f.name: f for f in FEATURES}
    passing = set().union(*(case_tags(features[r["feature"]]) for r in rows if r["ok"]))
    failed = sum(not r["ok"] for r in rows)
    missing = [name for name in required if name not in passing]
    return {
        "passed": len(rows) - failed,
        "failed": failed,
        "skipped": len(skipped),
        "seconds": round(seconds, 1),
        "required": {name: name in passing for name in required},
        "ok": bool(rows) and not failed and not missing,
    }


def summary_lines(summary: dict) -> list[str]:
    lines = [
        f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped (declared "
        f"unsupported) in {summary['seconds']:.1f} s"
    ]
    if summary["passed"] + summary["failed"] == 0:
        lines.append("FAIL: no case ran (every case was skipped or none was selected)")
    missing = [name for name, ok in summary["required"].items() if not ok]
    if missing:
        lines.append(f"FAIL: no passing case for --require {', '.join(missing)}")
    return lines


def jsonable(value: object) -> object:
    """``value`` with the numbers JSON lacks (inf, nan) as strings and other objects by ``str``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
