"""A guard for the rule that a model forward and a backend's per-layer calls never sync with the device.

Inside :func:`no_host_sync`, every tensor method that copies a device value to the host (``item``,
``tolist``, and the conversions ``bool(t)``, ``int(t)``, ``float(t)``) raises ``AssertionError``.
On a CPU nothing actually waits, but the same calls are the ones that would stall a GPU stream or
break a captured graph, so the guard finds them on any machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SYNCING = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise ``AssertionError`` on any device-to-host read of a tensor value inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}
    try:
        for name in saved:
            setattr(torch.Tensor, name, _refusing(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _refusing(name: str):
    def refuse(self, *args, **kwargs):
        raise AssertionError(f"host sync inside a region that must not sync (Tensor.{name})")

    return refuse
