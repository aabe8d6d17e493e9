"""When a burst's requests reach the server's ``accept`` and ``submit`` (the hand-off to the engine) in the server's
process, against when the client sent them (one clock: ``time.perf_counter`` is the system's monotonic clock).
Since round 41 also when the client wrote each body (aiohttp's trace) and when the server's ASGI application was
first called for each request and got its body; ``PRE_ENCODE=1``: the client's bodies encoded before the load
starts (as ``benchmarks.serve`` does since then); ``MAX_MODEL_LEN`` (default 2048; the tiny checkpoint: 1024).
Since round 43 the server's process freezes the start-up's objects after the app is built, as ``portattn serve``
does (``FREEZE=0``: not, as before), and the report counts the garbage collections by generation (how many, how
long) between the load's start and the last submit.

    python3 burst_probe.py serve MODEL_DIR PORT MARKS.json    # a server (engine in its own process; EP=0: a thread)
    python3 burst_probe.py client PORT N LENGTH VOCAB MODEL SENDS.json    # N completions of LENGTH random ids
    python3 burst_probe.py report SENDS.json MARKS.json

The server writes its marks when it gets SIGTERM.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import os
import random
import signal
import sys
import time


def serve(model: str, port: int, out: str) -> None:
    import uvicorn

    from portattn.server import app as app_mod
    from portattn.server import create_app

    marks = []
    accept, submit = app_mod.Server.accept, app_mod.Server.submit

    def timed_accept(self, *args, **kwargs):
        marks.append(("accept", time.perf_counter()))
        return accept(self, *args, **kwargs)

    def timed_submit(self, *args, **kwargs):
        stream = submit(self, *args, **kwargs)
        marks.append(("submit", time.perf_counter()))
        return stream

    app_mod.Server.accept, app_mod.Server.submit = timed_accept, timed_submit

    def write() -> None:
        with open(out, "w") as f:
            json.dump(marks, f)

    atexit.register(write)
    gc_started = [0.0]

    def gc_mark(phase: str, info: dict) -> None:  # each collection: ("gc", end, seconds, generation)
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            now = time.perf_counter()
            marks.append(("gc", now, now - gc_started[0], info["generation"]))

    gc.callbacks.append(gc_mark)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = create_app(
        model, page_size=16, num_pages=4000, max_num_seqs=256, max_model_len=int(os.environ.get("MAX_MODEL_LEN", 2048)),
        engine_process=os.environ.get("EP", "1") == "1",
    )  # fmt: skip
    inner = app
    if os.environ.get("FREEZE", "1") == "1":  # after the app is built, as ``portattn serve`` does
        from portattn.server.gc_pauses import freeze_start_up_objects

        freeze_start_up_objects()

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            marks.append(("asgi", time.perf_counter()))

            async def timed_receive():
                message = await receive()
                marks.append(("body", time.perf_counter()))
                return message

            return await inner(scope, timed_receive, send)
        return await inner(scope, receive, send)

    uvicorn.run(wrapped, host="127.0.0.1", port=port, log_level="warning")


async def burst(port: int, n: int, length: int, vocab: int, model: str) -> list[float]:
    import aiohttp

    rng = random.Random(0)
    sends = []

    def body() -> dict:
        return {"model": model, "prompt": [rng.randrange(3, vocab) for _ in range(length)], "max_tokens": 1,
                "stream": True, "ignore_eos": True}  # fmt: skip

    pre = [json.dumps(body()).encode() for _ in range(n)] if os.environ.get("PRE_ENCODE") == "1" else None

    async def one(session) -> None:
        if pre is not None:
            given = {"data": pre.pop(), "headers": {"Content-Type": "application/json"}}
        else:  # (encoded by aiohttp as the request starts, round 40's way)
            given = {"json": body()}
        sends.append(time.perf_counter())
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", **given) as resp:
            assert resp.status == 200, await resp.text()
            async for _ in resp.content:
                break

    sent = []

    async def on_sent(session, ctx, params):
        sent.append(time.perf_counter())

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_sent)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trace_configs=[trace]) as session:
        await asyncio.gather(*(one(session) for _ in range(n)))
    t0 = min(sends)
    ts = sorted(t - t0 for t in sent)
    print("body written", " ".join(f"{ts[q] * 1e3:.1f}" for q in _ranks(len(ts))))
    return sends


def _ranks(n: int) -> list[int]:
    """The requests printed: the first ones, a few between, the last."""
    return sorted({q for q in (0, 1, 2, 10, 50, 128, 200) if q < n} | {n - 1})


def report(sends_path: str, marks_path: str) -> None:
    with open(sends_path) as f:
        sends = json.load(f)
    with open(marks_path) as f:
        marks = json.load(f)
    t0 = min(sends)
    accepted = sorted(t - t0 for kind, t, *_ in marks if kind == "accept" and t >= t0)
    submitted = sorted(t - t0 for kind, t, *_ in marks if kind == "submit" and t >= t0)
    end = max(submitted, default=0.0)
    collections = [
        (took, gen) for kind, t, *rest in marks if kind == "gc" and 0 <= t - t0 <= end for took, gen in [rest]
    ]
    by_gen = {g: [took for took, gen in collections if gen == g] for g in (0, 1, 2)}
    print(
        "garbage collections until the last submit:",
        ", ".join(f"generation {g}: {len(ts)} ({sum(ts) * 1e3:.1f} ms)" for g, ts in by_gen.items()),
    )
    for kind in ("asgi", "body"):
        ts = sorted(t - t0 for k, t, *_ in marks if k == kind and t >= t0)
        print(kind, " ".join(f"{ts[q] * 1e3:.1f}" for q in _ranks(len(ts))))
    print(f"sent over {(max(sends) - t0) * 1e3:.1f} ms; {len(accepted)} accepted, {len(submitted)} submitted")
    for q in _ranks(len(submitted)):
        print(f"request {q:>3}: accepted {accepted[q] * 1e3:7.1f} ms, submitted {submitted[q] * 1e3:7.1f} ms")


def main() -> None:
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "client":
        port, n, length, vocab = map(int, sys.argv[2:6])
        sends = asyncio.run(asyncio.wait_for(burst(port, n, length, vocab, sys.argv[6]), 600))
        with open(sys.argv[7], "w") as f:
            json.dump(sends, f)
    else:
        report(sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    main()
