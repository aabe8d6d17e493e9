"""Tensor parallelism: one model over several devices, one process per device.

``group`` (the :class:`TPGroup` that layers are built for and its two collectives) has no engine
dependency; ``driver`` (rank 0: start the ranks, send each step, stop them), ``worker`` (the other
ranks) and ``protocol`` (the per-step message) are the engine's and are imported by it on demand.
"""

from .group import SINGLE, TPGroup, attention_heads

__all__ = ["SINGLE", "TPGroup", "attention_heads"]
