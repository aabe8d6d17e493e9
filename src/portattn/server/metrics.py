"""Prometheus metrics of the server (``GET /metrics``, text exposition format) and the periodic
statistics line in the log.

Gauges are read from the engine's statistics snapshot when scraped; counters and latency histograms
are updated by the request handlers as tokens arrive (TTFT: from the request's arrival to its first
token; inter-token latency: between a request's successive steps, once per token). Every choice is
counted once in ``request_success_total`` by its finish reason; a choice that never finished (its
client left, the server stopped) counts as ``abort``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.outputs import RequestOutput
from .async_engine import AsyncEngine, EngineStats

logger = logging.getLogger("portattn")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)


class _EngineCollector:
    def __init__(self, async_engine: AsyncEngine, model_name: str):
        self.engine = async_engine
        self.labels = {"model_name": model_name}

    def collect(self):
        s = self.engine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"portattn:{name}", doc, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), value)
            return g

        yield gauge("num_requests_running", "Sequences in the running batch.", s.running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled (preempted ones included).", s.waiting)
        yield gauge("kv_pages_used", "KV-cache pages held (by sequences or the prefix cache).", s.pages_used)
        yield gauge("kv_pages_free", "KV-cache pages free.", s.pages_free)
        yield gauge(
            "kv_pages_prefix_cache_only", "KV-cache pages only the prefix cache holds (reusable).", s.pages_evictable
        )
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache pages held by requests.", kv_cache_usage(s))
        rate = s.cached_prompt_tokens / s.queried_prompt_tokens if s.queried_prompt_tokens else 0.0
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.", rate)
        c = CounterMetricFamily(
            "portattn:num_preemptions", "Sequences preempted for lack of pages.", labels=["model_name"]
        )
        c.add_metric([self.labels["model_name"]], s.preemptions)
        yield c
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode)

    def _spec_decode(self, stats):
        """Speculative decoding's counters, named as vLLM names them (acceptance rate: accepted / draft tokens)."""
        model = [self.labels["model_name"]]
        for name, doc, value in (
            ("num_drafts", "Sequences that proposed tokens, per step.", stats.num_drafts),
            ("num_draft_tokens", "Proposed tokens.", stats.num_draft_tokens),
            ("num_accepted_tokens", "Proposed tokens accepted.", stats.num_accepted_tokens),
        ):
            c = CounterMetricFamily(f"portattn:spec_decode_{name}", doc, labels=["model_name"])
            c.add_metric(model, value)
            yield c
        c = CounterMetricFamily(
            "portattn:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the proposal.",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(stats.accepted_per_pos):
            c.add_metric([*model, str(position)], value)
        yield c


class ServerMetrics:
    """The server's metrics in their own registry (several servers can live in one process)."""

    def __init__(self, async_engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_engine, model_name))
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("portattn:prompt_tokens", "Prompt tokens of the requests.", labels, registry=r)
        self.generation_tokens = Counter("portattn:generation_tokens", "Tokens generated.", labels, registry=r)
        self.requests = Counter(
            "portattn:request_success", "Requests finished, by finish reason.", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "portattn:time_to_first_token_seconds", "Time to first token.", labels, buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "portattn:time_per_output_token_seconds",
            "Latency per output token after the first (inter-token latency).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "portattn:e2e_request_latency_seconds", "Request latency.", labels, buckets=_TTFT_BUCKETS, registry=r
        )
        self.model_name = model_name
        # Each streamed token updates these: their children for this model are looked up once, not a token
        # (prometheus_client's labels() was a fifth of the event loop's time a token).
        self.generation_tokens_of = self.labelled(self.generation_tokens)
        self.ttft_of, self.itl_of, self.e2e_of = (self.labelled(h) for h in (self.ttft, self.itl, self.e2e))
        self._requests_of: dict[str, object] = {}

    def labelled(self, metric):
        return metric.labels(model_name=self.model_name)

    def finished(self, reason: str):
        """The request counter's child for this model and finish ``reason``."""
        child = self._requests_of.get(reason)
        if child is None:
            child = self._requests_of[reason] = self.requests.labels(model_name=self.model_name, finished_reason=reason)
        return child


class Timing:
    """Per HTTP request: TTFT, inter-token latency, token counts and finish reasons for the metrics."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompts: int, seqs_per_prompt: int):
        self.metrics = metrics
        self.arrival = arrival
        self.last: list[float | None] = [None] * num_prompts
        self.completion_tokens = 0
        self.open_choices = num_prompts * seqs_per_prompt

    def step(self, index: int, out: RequestOutput) -> None:
        now = time.perf_counter()
        new = sum(len(c.token_ids) for c in out.outputs)
        self.completion_tokens += new
        m = self.metrics
        if new:
            m.generation_tokens_of.inc(new)
            last = self.last[index]
            if last is None:
                m.ttft_of.observe(now - self.arrival)
            else:  # one step: one more token per running choice; a delta a slow reader left carries several
                steps = max(len(c.token_ids) for c in out.outputs)
                for _ in range(steps):
                    m.itl_of.observe((now - last) / steps)
            self.last[index] = now
        for c in out.outputs:
            if c.finish_reason is not None:
                m.finished(c.finish_reason).inc()
                self.open_choices -= 1
        if out.finished:
            m.e2e_of.observe(now - self.arrival)

    def close(self) -> None:
        """At the end of the HTTP request: the choices that did not finish count as aborted."""
        if self.open_choices > 0:
            self.metrics.finished("abort").inc(self.open_choices)
            self.open_choices = 0


async def log_stats(async_engine: AsyncEngine, interval: float) -> None:
    """Every ``interval`` seconds while the engine works: throughput since the last line, running and
    waiting sequences, KV-cache and prefix-cache use, and the CPU time of the engine thread and of the
    event loop (this coroutine's thread), at INFO (``--disable-log-stats`` turns it off)."""
    last, last_time, last_loop_cpu = async_engine.stats, time.monotonic(), time.thread_time()
    while True:
        await asyncio.sleep(interval)
        now, s, loop_cpu = time.monotonic(), async_engine.stats, time.thread_time()
        if _busy(s, last):
            try:
                logger.info(stats_line(s, last, now - last_time, loop_cpu_s=loop_cpu - last_loop_cpu))
            except Exception:  # a line that cannot be made is reported; the next interval tries again
                logger.exception("the statistics line failed")
        last, last_time, last_loop_cpu = s, now, loop_cpu


def _busy(s: EngineStats, last: EngineStats) -> bool:
    moved = (s.prompt_tokens, s.generation_tokens) != (last.prompt_tokens, last.generation_tokens)
    return moved or s.running > 0 or s.waiting > 0


def kv_cache_usage(s: EngineStats) -> float:
    """The fraction of the KV cache's pages that requests hold: pages that only the prefix cache keeps
    are reusable at once and count as free (as vLLM's ``kv_cache_usage_perc`` counts them)."""
    total = s.pages_used + s.pages_free
    return (s.pages_used - s.pages_evictable) / total if total else 0.0


def stats_line(s: EngineStats, last: EngineStats, seconds: float, loop_cpu_s: float | None = None) -> str:
    """The statistics line of ``seconds`` from ``last`` to ``s``; with ``loop_cpu_s`` (the event loop's CPU
    seconds meanwhile) also the engine thread's and the loop's CPU time as percentages of one core: the two
    share the GIL, so a loop near 100% delays the engine's next launch."""
    total = s.pages_used + s.pages_free
    hits = s.cached_prompt_tokens / s.queried_prompt_tokens if s.queried_prompt_tokens else 0.0
    seconds = max(seconds, 1e-9)
    line = (
        f"stats: prompt {(s.prompt_tokens - last.prompt_tokens) / seconds:.1f} tok/s, "
        f"generation {(s.generation_tokens - last.generation_tokens) / seconds:.1f} tok/s, "
        f"running {s.running}, waiting {s.waiting}, "
        f"KV cache {100 * kv_cache_usage(s):.1f}% of {total} pages, "
        f"prefix cache hits {100 * hits:.1f}%"
    )
    if loop_cpu_s is not None and last.engine_cpu_s:  # no step published before the interval: no engine share
        engine = 100 * (s.engine_cpu_s - last.engine_cpu_s) / seconds
        line += f", CPU: engine thread {engine:.0f}%, event loop {100 * loop_cpu_s / seconds:.0f}%"
    return line
