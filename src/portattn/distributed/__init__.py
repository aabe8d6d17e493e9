"""Tensor parallelism: one model over several devices, one process per device.

This package holds what the layers are built for: ``group`` (the :class:`TPGroup` and its two
collectives), with no engine dependency. Starting the ranks, sending each step and stopping them is
the engine's orchestration, in :mod:`portattn.engine.parallel`.
"""

from .group import SINGLE, TPGroup, attention_heads

__all__ = ["SINGLE", "TPGroup", "attention_heads"]
