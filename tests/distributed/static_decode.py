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


def cascade_from_two_sequences(engine) -> None:
    """Rank 0's rule takes every step of two or more sequences that share a page (the other ranks
    attend as rank 0's step message says)."""
    import dataclasses

    rule = engine.runner.cascade_rule
    engine.runner.cascade_rule = dataclasses.replace(
        rule, min_batch=2, min_shared_tokens=1, graph_min_saved_bytes=0, eager_min_saved_bytes=0
    )


def fewest_cascade_steps(engine) -> int:
    """The fewest cascade steps any rank ran (a collective: every rank calls it)."""
    import torch

    steps = torch.tensor([float(engine.runner.cascade_steps)])
    if engine.tp.size > 1:
        group = engine.tp.cpu_group or engine.tp.group
        torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(steps)
