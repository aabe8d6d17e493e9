"""The server's statistics line: throughput, cache use, and the CPU time of the engine thread and of the event
loop (they share the GIL) as percentages of one core over the interval."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from portattn.server import metrics
from portattn.server.async_engine import AsyncEngine, EngineStats
from portattn.server.metrics import stats_line


def test_the_line_gives_each_threads_cpu_share_of_the_interval():
    last = EngineStats(generation_tokens=100, pages_used=10, pages_free=30, engine_cpu_s=3.0)
    now = EngineStats(generation_tokens=500, pages_used=20, pages_free=20, engine_cpu_s=4.5)
    line = stats_line(now, last, 2.0, loop_cpu_s=0.4)
    assert "generation 200.0 tok/s" in line and "KV cache 50.0% of 40 pages" in line
    assert line.endswith(", CPU: engine thread 75%, event loop 20%")
    assert "CPU" not in stats_line(now, last, 2.0)  # no loop time given
    assert "CPU" not in stats_line(now, EngineStats(), 2.0, loop_cpu_s=0.4)  # no step published before


def test_pages_only_the_prefix_cache_holds_are_not_counted_as_in_use():
    """As vLLM's usage: 20 of 40 pages held, 10 of them by the prefix cache alone, is 25% in use."""
    s = EngineStats(pages_used=20, pages_free=20, pages_evictable=10)
    assert "KV cache 25.0% of 40 pages" in stats_line(s, EngineStats(), 1.0)


def test_published_stats_carry_the_engine_threads_own_cpu_time():
    """``_publish`` runs on the engine thread and records that thread's CPU time, not the process's."""
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(running=[], waiting=[], num_preemptions=0),
        allocator=SimpleNamespace(num_used=0, num_free=8, num_evictable=0),
        pages=SimpleNamespace(num_cached_tokens=0),
        num_prompt_tokens_computed=0,
        num_generated_tokens=0,
        speculator=None,
    )
    async_engine = AsyncEngine.__new__(AsyncEngine)
    async_engine.engine, async_engine.stats, async_engine._streams, async_engine._queried = engine, EngineStats(), {}, 0
    seen = {}

    def engine_thread():
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # 50 ms of this thread's CPU
            pass
        async_engine._publish()
        seen["after"] = time.thread_time()

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    # at most what that thread had used when it returned: the process's time (this test's imports) is more
    assert 0.05 <= async_engine.stats.engine_cpu_s <= seen["after"]
    assert async_engine.stats.steps == 1


def test_a_line_that_fails_is_reported_and_the_next_interval_logs_again(monkeypatch, caplog):
    import asyncio
    import logging

    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("a broken statistic")
        return "stats: fine"

    monkeypatch.setattr(metrics, "stats_line", flaky)
    engine = SimpleNamespace(stats=EngineStats())

    async def run():
        task = asyncio.create_task(metrics.log_stats(engine, 0.01))
        for tokens in range(1, 40):  # every interval sees new tokens: busy
            engine.stats = EngineStats(generation_tokens=tokens)
            await asyncio.sleep(0.005)
            if len(calls) >= 2:
                break
        task.cancel()

    with caplog.at_level(logging.INFO, logger="portattn"):
        asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records]
    assert "the statistics line failed" in messages and "stats: fine" in messages
