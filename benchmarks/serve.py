"""``python -m benchmarks.serve``: a serving benchmark client for an OpenAI-compatible server.

Definitions as in vLLM's ``bench serve``: every request streams; TTFT is the time from sending the
request to the arrival of its first streamed token; ITL the gaps between successive chunks; E2EL the
time to the last chunk; TPOT = (E2EL - TTFT) / (output tokens - 1); input and output tokens as the
server's usage reports them. Throughputs divide by the wall time from the first request to the last
answer. The summary is printed as a block (mean, median, p90, p99 per latency) and written as JSON.

Requests (``benchmarks/serve_datasets.py``): random token ids (exact input lengths; the vocabulary's
special tokens left out), a ShareGPT-format file, or a file of prompts, sent with ``ignore_eos``
(exact output lengths) to ``--endpoint`` ``/v1/completions`` or ``/v1/chat/completions``. Requests
arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once), at most
``--max-concurrency`` in flight. ``--start-server`` starts ``portattn serve`` itself (arguments after
``--`` go to it) and stops it at the end: one command for a whole run.

    python -m benchmarks.serve --start-server --model DIR --num-prompts 200 --request-rate 8 \\
        --input-len 256 --output-len 64 --result-json benchmarks/results/serve.json -- --page-size 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .serve_datasets import DATASETS, BenchRequest, load_requests, load_tokenizer

PERCENTILES = (90, 99)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestResult:
    input_len: int = 0  # tokens, from the server's usage
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    start: float = 0.0  # when it was sent, in seconds from the load's start

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def request_body(endpoint: str, model: str, request: BenchRequest) -> dict:
    body = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "/v1/chat/completions":
        return {**body, "messages": [{"role": "user", "content": request.prompt}]}
    return {**body, "prompt": request.prompt}


def _carries_tokens(choice: dict) -> bool:
    """Every chunk carries a step's tokens but the chat role chunk that opens each choice."""
    return "role" not in choice.get("delta", {})


async def one_request(session, url: str, body: bytes, api_key) -> RequestResult:
    """One streamed request of ``body`` (JSON, encoded before the load starts: the client's own encoding of a
    burst's bodies would otherwise delay every request's first byte, and count in its TTFT)."""
    import aiohttp

    result = RequestResult()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    start = result.start = time.perf_counter()
    last = None
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                choices = chunk.get("choices") or []
                if any(_carries_tokens(c) for c in choices):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.input_len = chunk["usage"]["prompt_tokens"]
                    result.output_len = chunk["usage"]["completion_tokens"]
        result.latency = (last or time.perf_counter()) - start
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_load(args, base_url: str, model: str, requests: list[BenchRequest]) -> tuple[list, float, float]:
    """The requests' results, the load's duration and its start (``time.perf_counter``)."""
    import aiohttp

    url = base_url + args.endpoint
    rng = random.Random(args.seed + 1)
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = BenchRequest(requests[0].prompt, 2)
        warm_body = json.dumps(request_body(args.endpoint, model, warm)).encode()
        warm_result = await one_request(session, url, warm_body, args.api_key)
        if warm_result.error:
            raise SystemExit(f"the warm-up request failed: {warm_result.error}")
        bodies = [json.dumps(request_body(args.endpoint, model, r)).encode() for r in requests]

        async def limited(body: bytes):
            if gate is None:
                return await one_request(session, url, body, args.api_key)
            async with gate:
                return await one_request(session, url, body, args.api_key)

        tasks = []
        start = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.ensure_future(limited(body)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        for result in results:
            result.start -= start
        return results, time.perf_counter() - start, start


def latency_stats(values: list[float]) -> dict:
    """Mean, median, p90 and p99 in ms (percentiles interpolated between ranks, as numpy's default)."""
    if not values:
        return {}
    ms = sorted(v * 1000 for v in values)

    def percentile(p: float) -> float:
        x = (len(ms) - 1) * p / 100
        lo = int(x)
        return ms[lo] + (ms[min(lo + 1, len(ms) - 1)] - ms[lo]) * (x - lo)

    return {"mean_ms": statistics.fmean(ms), "median_ms": percentile(50)} | {
        f"p{p}_ms": percentile(p) for p in PERCENTILES
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": latency_stats([r.ttft for r in ok]),
        "tpot": latency_stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": latency_stats([gap for r in ok for gap in r.itl]),
        "e2el": latency_stats([r.latency for r in ok]),
    }


def server_metrics(base_url: str) -> dict:
    """The server's gauges and counters (``/metrics``) without histogram buckets."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "_bucket" not in line and "_created" not in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[-1]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = args.port or _free_port()
    cmd = [sys.executable, "-m", "portattn.cli", "serve", args.model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *extra]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.server_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"the server did not become healthy in {args.server_timeout} s: {' '.join(cmd)}")


_WIDTH = 52
_LATENCIES = {
    "ttft": ("Time to first token", "TTFT"),
    "tpot": ("Time per output token (first excluded)", "TPOT"),
    "itl": ("Inter-token latency", "ITL"),
    "e2el": ("End-to-end request latency", "E2EL"),
}


def result_block(summary: dict, config: dict) -> str:
    """The run as a block of aligned lines: load, totals and throughputs, then each latency's mean,
    median, p90 and p99."""

    def row(name: str, value) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{name + ':':<38}{text:>14}"

    rate = config["request_rate"]
    lines = [
        " serving benchmark ".center(_WIDTH, "="),
        row("Endpoint", config["endpoint"]),
        row("Dataset", config["dataset"]),
        row("Request rate (req/s)", "inf" if rate == "inf" else float(rate)),
        row("Max concurrency", config["max_concurrency"] or "unlimited"),
        row("Successful requests", summary["completed"]),
        row("Failed requests", summary["failed"]),
        row("Benchmark duration (s)", summary["duration_s"]),
        row("Total input tokens", summary["total_input_tokens"]),
        row("Total generated tokens", summary["total_output_tokens"]),
        row("Request throughput (req/s)", summary["request_throughput"]),
        row("Output token throughput (tok/s)", summary["output_throughput"]),
        row("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    for key, (title, short) in _LATENCIES.items():
        stats = summary[key]
        if not stats:
            continue
        lines.append(f" {title} ".center(_WIDTH, "-"))
        lines.append(row(f"Mean {short} (ms)", stats["mean_ms"]))
        lines.append(row(f"Median {short} (ms)", stats["median_ms"]))
        lines += [row(f"P{p} {short} (ms)", stats[f"p{p}_ms"]) for p in PERCENTILES]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: http://127.0.0.1:--port)")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--model", default=None, help="the served model name; with --start-server its directory")
    parser.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS, help="(default: %(default)s)")
    parser.add_argument("--start-server", action="store_true", help="start `portattn serve` (args after --)")
    parser.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for the server")
    parser.add_argument("--server-log", default=None, help="file for the started server's output")
    parser.add_argument("--api-key", default=None)
    data = parser.add_argument_group("requests")
    data.add_argument("--dataset-name", choices=DATASETS, default=None, help="(default: random; with a path, its kind)")
    data.add_argument("--dataset-path", "--dataset", default=None, help="a ShareGPT JSON file or a file of prompts")
    data.add_argument("--tokenizer", default=None, help="for random ids and ShareGPT lengths (default: --model dir)")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--input-len", type=int, default=128, help="random prompts' tokens")
    data.add_argument("--output-len", type=int, default=64, help="tokens per request (ShareGPT: without a tokenizer)")
    data.add_argument("--fixed-output-len", action="store_true", help="ShareGPT: --output-len, not the reply's")
    data.add_argument("--range-ratio", type=float, default=0.0, help="random lengths uniform in [L(1-r), L(1+r)]")
    data.add_argument("--token-range", type=int, nargs=2, default=(1, 256), help="ids in [a, b) without tokenizer")
    data.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per s (inf: at once)")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--request-timeout", type=float, default=3600)
    parser.add_argument("--result-json", default=None, help="write the summary and per-request results here")
    parser.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.range_ratio < 1:
        parser.error(f"expected --range-ratio in [0, 1), got {args.range_ratio}")
    if args.start_server and not args.model:
        parser.error("--start-server needs --model DIR")
    if args.tokenizer is None and args.model and (Path(args.model).is_dir() or args.model.endswith(".gguf")):
        args.tokenizer = args.model
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    rng = random.Random(args.seed)
    dataset, requests = load_requests(args, rng, load_tokenizer(args.tokenizer), args.endpoint != ENDPOINTS[0])
    proc = None
    if args.start_server:
        proc, base_url = start_server(args, extra)
    else:
        base_url = args.base_url or f"http://127.0.0.1:{args.port or 8000}"
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(base_url + "/v1/models", headers=headers), timeout=30) as r:
            served = json.loads(r.read())["data"][0]["id"]
        model = served if args.model is None or args.start_server else args.model
        results, duration, started = asyncio.run(run_load(args, base_url, model, requests))
        summary = summarize(results, duration)
        metrics = server_metrics(base_url)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    config["server_args"] = extra
    config["dataset"] = dataset
    print(result_block(summary, config))
    if args.result_json:
        out = {
            "config": config,
            "summary": summary,
            "server_metrics": metrics,
            "requests": [{**asdict(r), "tpot": r.tpot} for r in results],
            # the requests' start times are from this; time.perf_counter is the system's monotonic clock on Linux,
            # as in the engine loop's trace (PORTATTN_STEP_TRACE): the two line up on one machine
            "load_start_perf_counter_s": started,
        }
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
