"""Functions the tests run on every rank through ``Engine.call`` (importable by the ranks)."""

from __future__ import annotations

from portattn.engine.graphs import batch_size_buckets


def enable_static_decode(engine) -> None:
    """Decode steps through the static buffers and per-bucket plans of captured decode, run eagerly
    (the path a GPU captures; the CPU has no graphs)."""
    graphs = engine.runner.enable_graphs(batch_size_buckets(engine.config.max_num_seqs), capture=False)
    graphs.capture_all()


def static_replays(engine) -> int:
    return engine.runner.graphs.replays


def graph_samples(engine) -> int:
    """Decode steps that sampled inside the graph (rank 0; the other ranks only run the forward)."""
    return engine.runner.graphs.sampled
