"""An out-of-tree attention backend for the registration tests: the reference backend under its
own name, counting the paged-attention calls it makes in its process.
``--register distributed.counting_backend:register`` registers it (``tests/`` on the import path)."""

from __future__ import annotations

import torch.distributed as dist

from portattn.backends.registry import register_backend
from portattn.backends.torch_ref import TorchBackend

NAME = "counting"


def register() -> None:
    register_backend(NAME, f"{__name__}:CountingBackend")


class CountingBackend(TorchBackend):
    name = NAME
    priority = -1  # auto never picks it over the built-in backends

    def __init__(self):
        super().__init__()
        self.calls = 0

    def paged_attention(self, *args, **kwargs):
        self.calls += 1
        return super().paged_attention(*args, **kwargs)


def backend_report(engine) -> list[tuple[str, int]]:
    """``(backend name, its paged-attention calls)`` of every rank, gathered on each (for ``Engine.call``)."""
    mine = (engine.backend.name, getattr(engine.backend, "calls", 0))
    if engine.tp.size == 1:
        return [mine]
    out = [None] * engine.tp.size
    dist.all_gather_object(out, mine, group=engine.tp.cpu_group)
    return out
