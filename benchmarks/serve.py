"""``python -m benchmarks.serve``: a serving benchmark client for an OpenAI-compatible server.

Definitions as in vLLM's ``bench serve``: every request streams; TTFT is the time from sending the
request to the arrival of its first streamed chunk; ITL the gaps between successive chunks; E2EL the
time to the last chunk; TPOT = (E2EL - TTFT) / (output tokens - 1), output tokens as the server's
usage reports them. Throughputs divide by the wall time from the first request to the last answer.

Prompts are random token ids (exact input lengths) sent to ``/v1/completions`` with
``ignore_eos`` (exact output lengths), fixed or drawn uniformly from ``[L (1 - r), L (1 + r)]`` with
``--range-ratio r``. Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``:
all at once), at most ``--max-concurrency`` in flight. ``--start-server`` starts ``portattn serve``
itself (arguments after ``--`` go to it) and stops it at the end: one command for a whole run.

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

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    input_len: int
    output_len: int = 0  # tokens, from the server's usage
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def sample_lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    if ratio == 0:
        return [mean] * n
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_requests(args, rng: random.Random) -> list[tuple[list[int], int]]:
    inputs = sample_lengths(args.num_prompts, args.input_len, args.range_ratio, rng)
    outputs = sample_lengths(args.num_prompts, args.output_len, args.range_ratio, rng)
    low, high = args.token_range
    return [([rng.randrange(low, high) for _ in range(n)], m) for n, m in zip(inputs, outputs)]


async def one_request(session, url: str, model: str, prompt: list[int], max_tokens: int, api_key) -> RequestResult:
    import aiohttp

    result = RequestResult(input_len=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
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
                if chunk.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
        result.latency = (last or time.perf_counter()) - start
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_load(args, base_url: str, model: str, requests: list[tuple[list[int], int]]) -> tuple[list, float]:
    import aiohttp

    url = base_url + "/v1/completions"
    rng = random.Random(args.seed + 1)
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = await one_request(session, url, model, requests[0][0], 2, args.api_key)
        if warm.error:
            raise SystemExit(f"the warm-up request failed: {warm.error}")

        async def limited(prompt, max_tokens):
            if gate is None:
                return await one_request(session, url, model, prompt, max_tokens, args.api_key)
            async with gate:
                return await one_request(session, url, model, prompt, max_tokens, args.api_key)

        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)

    def stats(values: list[float]) -> dict:
        if not values:
            return {}
        ms = sorted(v * 1000 for v in values)
        d = {"mean_ms": statistics.fmean(ms)}
        for p in PERCENTILES:  # linear interpolation between ranks (numpy's default)
            x = (len(ms) - 1) * p / 100
            lo = int(x)
            d[f"p{p}_ms"] = ms[lo] + (ms[min(lo + 1, len(ms) - 1)] - ms[lo]) * (x - lo)
        return d

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
        "ttft": stats([r.ttft for r in ok]),
        "tpot": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": stats([gap for r in ok for gap in r.itl]),
        "e2el": stats([r.latency for r in ok]),
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
    cmd = [sys.executable, "-m", "portattn.cli", "serve", "--model", args.model, "--host", "127.0.0.1"]
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


def print_table(summary: dict) -> None:
    print(f"{'completed':<28}{summary['completed']} ({summary['failed']} failed)")
    print(f"{'duration (s)':<28}{summary['duration_s']:.2f}")
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        print(f"{key + ' (/s)':<28}{summary[key]:.2f}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = summary[name]
        if s:
            cells = "  ".join(f"{k[:-3]} {v:.2f}" for k, v in s.items())
            print(f"{name.upper() + ' (ms)':<28}{cells}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: http://127.0.0.1:--port)")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--model", default=None, help="the served model name; with --start-server its directory")
    parser.add_argument("--start-server", action="store_true", help="start `portattn serve` (args after --)")
    parser.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for the server")
    parser.add_argument("--server-log", default=None, help="file for the started server's output")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    parser.add_argument("--token-range", type=int, nargs=2, default=(1, 256), help="prompt token ids in [a, b)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per s (inf: at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--request-timeout", type=float, default=3600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None, help="write the summary and per-request results here")
    parser.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.range_ratio < 1:
        parser.error(f"expected --range-ratio in [0, 1), got {args.range_ratio}")
    proc = None
    if args.start_server:
        if not args.model:
            parser.error("--start-server needs --model DIR")
        proc, base_url = start_server(args, extra)
    else:
        base_url = args.base_url or f"http://127.0.0.1:{args.port or 8000}"
    try:
        model = args.model
        with urllib.request.urlopen(
            urllib.request.Request(
                base_url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            ),
            timeout=30,
        ) as resp:
            served = json.loads(resp.read())["data"][0]["id"]
        model = served if model is None or args.start_server else model
        requests = make_requests(args, random.Random(args.seed))
        results, duration = asyncio.run(run_load(args, base_url, model, requests))
        summary = summarize(results, duration)
        metrics = server_metrics(base_url)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(summary)
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
        config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
        config["server_args"] = extra
        out = {
            "config": config,
            "summary": summary,
            "server_metrics": metrics,
            "requests": [{**asdict(r), "tpot": r.tpot} for r in results],
        }
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
