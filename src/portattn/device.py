"""The one place that asks a device about itself.

Everything vendor-specific (CUDA's multiprocessor count, Intel's XPU properties) is read here,
with a portable fallback, so that the rest of portattn stays device neutral. Nothing that decides
correctness may depend on these numbers: they only tune performance.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch


def is_triton_interpreter() -> bool:
    """True when Triton kernels run on the CPU through ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_gpu(device: torch.device | str) -> bool:
    """True for accelerators that Triton compiles for (NVIDIA/AMD via ``cuda``, Intel via ``xpu``)."""
    return torch.device(device).type in ("cuda", "xpu")


@functools.cache
def _compute_units(device_type: str, index: int) -> int:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(index).multi_processor_count
    if device_type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        props = torch.xpu.get_device_properties(index)
        for name in ("gpu_subslice_count", "max_compute_units"):
            if getattr(props, name, 0):
                return int(getattr(props, name))
    return os.cpu_count() or 1


def compute_units(device: torch.device | str) -> int:
    """Number of parallel compute units (SMs, CUs, Xe cores; CPU cores as a fallback).

    Used only to size launch grids for speed; never to size memory or pick results.
    """
    device = torch.device(device)
    return _compute_units(device.type, device.index or 0)


@functools.cache
def _shared_memory(device_type: str, index: int) -> int | None:
    if device_type == "cuda" and torch.cuda.is_available():
        value = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
        if value:
            return int(value)
    if device_type in ("cuda", "xpu"):
        try:  # Triton's own figure, the one its launches are checked against
            from triton.runtime import driver

            return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
        except (ImportError, AttributeError, KeyError, RuntimeError):
            return None
    return None


def max_shared_memory(device: torch.device | str) -> int | None:
    """Bytes of shared memory (LDS, SLM) one program may use on ``device``; ``None`` if unknown.

    Used only to choose kernel tiles that fit before compiling them; never to pick results.
    """
    device = torch.device(device)
    if is_triton_interpreter() or device.type == "cpu":
        return None
    return _shared_memory(device.type, device.index or 0)


def synchronize(device: torch.device | str) -> None:
    """Wait for all work queued on ``device``."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    torch.accelerator.synchronize(device)


def default_device() -> torch.device:
    """The current accelerator if there is one, else the CPU."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


# -- graphs ------------------------------------------------------------------------------------
# Graph capture replays a recorded sequence of kernel launches with one host call. torch has it
# for NVIDIA/AMD (``torch.cuda.CUDAGraph``) and, in recent versions, Intel (``torch.xpu.XPUGraph``).


def graph_support(device: torch.device | str) -> str | None:
    """The graph API torch has for ``device`` (``"cuda"`` or ``"xpu"``), or ``None`` (run eagerly)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return "cuda"
    if device.type == "xpu" and hasattr(torch, "xpu") and hasattr(torch.xpu, "XPUGraph") and torch.xpu.is_available():
        return "xpu"
    return None


def _graph_module(device: torch.device | str):
    kind = graph_support(device)
    if kind is None:
        raise ValueError(f"expected a device with graph support (cuda, xpu), got {torch.device(device)}")
    return torch.cuda if kind == "cuda" else torch.xpu


def new_graph(device: torch.device | str):
    """An empty graph for ``device`` (``torch.cuda.CUDAGraph`` or ``torch.xpu.XPUGraph``)."""
    module = _graph_module(device)
    return module.CUDAGraph() if module is torch.cuda else module.XPUGraph()


@contextlib.contextmanager
def graph_capture(device: torch.device | str, graph, pool=None):
    """Record the work queued inside the ``with`` block on ``device`` into ``graph`` (nothing runs).

    ``pool``: the memory pool of an earlier graph (``graph.pool()``), so that graphs share memory.
    """
    module = _graph_module(device)
    with module.device(torch.device(device)), module.graph(graph, pool=pool):
        yield
