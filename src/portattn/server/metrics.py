"""Prometheus metrics of the server (``GET /metrics``, text exposition format).

Gauges are read from the engine's statistics snapshot when scraped; counters and latency histograms
are updated by the request handlers as tokens arrive (TTFT: from the request's arrival to its first
token; inter-token latency: between a request's successive steps, once per token).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .async_engine import AsyncEngine

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
        total = s.pages_used + s.pages_free
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache pages held.", s.pages_used / total if total else 0.0)
        rate = s.cached_prompt_tokens / s.queried_prompt_tokens if s.queried_prompt_tokens else 0.0
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.", rate)
        c = CounterMetricFamily(
            "portattn:num_preemptions", "Sequences preempted for lack of pages.", labels=["model_name"]
        )
        c.add_metric([self.labels["model_name"]], s.preemptions)
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

    def labelled(self, metric):
        return metric.labels(model_name=self.model_name)
