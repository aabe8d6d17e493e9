"""The engine's metrics as objects, in the shapes of vLLM's ``vllm.v1.metrics.reader`` (``LLM.get_metrics()``).

Each metric has a ``name`` (``portattn:...``, the name the server's ``/metrics`` exposes, without the
``_total`` a Prometheus counter gets there) and ``labels``; a :class:`Counter` has an int ``value``,
a :class:`Gauge` a float ``value``, a :class:`Vector` a list of int ``values`` (a counter per
position). With speculative decoding, the acceptance rate is
``spec_decode_num_accepted_tokens / spec_decode_num_draft_tokens`` and the mean number of tokens a
verification step emits per sequence is ``1 + num_accepted_tokens / num_drafts``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing count."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Vector(Metric):
    """Counters by position (``values[i]`` counts position ``i``)."""

    values: list[int]


def engine_metrics(engine) -> list[Metric]:
    """The engine's gauges and counters now (the counters start after the warm-up)."""
    labels = {"model_name": engine.config.model}
    scheduler, allocator = engine.scheduler, engine.allocator
    out: list[Metric] = [
        Gauge("portattn:num_requests_running", dict(labels), float(len(scheduler.running))),
        Gauge("portattn:num_requests_waiting", dict(labels), float(len(scheduler.waiting))),
        Gauge(  # pages only the prefix cache holds are reusable at once: not counted, as vLLM does not
            "portattn:kv_cache_usage_perc",
            dict(labels),
            (allocator.num_used - allocator.num_evictable) / allocator.num_pages,
        ),
        Counter("portattn:num_preemptions", dict(labels), scheduler.num_preemptions),
        Counter("portattn:prompt_tokens", dict(labels), engine.num_prompt_tokens_computed),
        Counter("portattn:generation_tokens", dict(labels), engine.num_generated_tokens),
        Counter("portattn:prefix_cache_hits", dict(labels), engine.pages.num_cached_tokens),
    ]
    if engine.speculator is not None:
        out += spec_decode_metrics(engine.speculator.stats, labels)
    return out


def spec_decode_metrics(stats, labels: dict[str, str]) -> list[Metric]:
    """The speculative-decoding counters of a ``SpecDecodeStats``."""
    return [
        Counter("portattn:spec_decode_num_drafts", dict(labels), stats.num_drafts),
        Counter("portattn:spec_decode_num_draft_tokens", dict(labels), stats.num_draft_tokens),
        Counter("portattn:spec_decode_num_accepted_tokens", dict(labels), stats.num_accepted_tokens),
        Vector("portattn:spec_decode_num_accepted_tokens_per_pos", dict(labels), list(stats.accepted_per_pos)),
    ]
