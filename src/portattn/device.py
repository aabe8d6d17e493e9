"""The one place that asks a device about itself.

Everything vendor-specific (CUDA's multiprocessor count, Intel's XPU properties) is read here,
with a portable fallback, so that the rest of portattn stays device neutral. Nothing that decides
correctness may depend on these numbers: they only tune performance.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
import subprocess

import torch


def is_triton_interpreter() -> bool:
    """True when Triton kernels run on the CPU through ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_gpu(device: torch.device | str) -> bool:
    """True for accelerators that Triton compiles for (NVIDIA/AMD via ``cuda``, Intel via ``xpu``)."""
    return torch.device(device).type in ("cuda", "xpu")


def upload(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small host list as a tensor on ``device``, queued without waiting for the device: on an
    accelerator from pinned memory by an asynchronous copy (a copy from pageable memory synchronizes
    the stream, so the host would wait for every step queued before it)."""
    host = torch.tensor(values, dtype=dtype)
    if is_gpu(device):
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
def _device_model(device_type: str, index: int) -> str | None:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(index)
    if device_type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.get_device_name(index)
    return None


def device_model(device: torch.device | str) -> str | None:
    """The accelerator's model name (``torch.cuda.get_device_name``: "NVIDIA H200"); ``None`` on the CPU
    and under the Triton interpreter. Used only to choose kernel tiles measured on that model."""
    device = torch.device(device)
    if is_triton_interpreter() or device.type == "cpu":
        return None
    return _device_model(device.type, device.index or 0)


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


# Triton's names of the fp8 formats the KV caches use.
_TRITON_FP8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}


def fp8_dtypes_of_target(target) -> frozenset[torch.dtype]:
    """The KV-cache fp8 dtypes Triton's backend for ``target`` (a ``triton.backends.compiler.GPUTarget``)
    lists as supported, natively or emulated (NVIDIA: e5m2, and e4m3 from sm_89; AMD and Intel: as
    their Triton backends declare them for the architecture)."""
    from triton.compiler.compiler import make_backend

    names = make_backend(target).parse_options({}).supported_fp8_dtypes
    return frozenset(_TRITON_FP8[name] for name in names if name in _TRITON_FP8)


@functools.cache
def _triton_fp8_dtypes(device_type: str, index: int) -> frozenset[torch.dtype] | None:
    try:
        from triton.runtime import driver

        with (torch.cuda if device_type == "cuda" else torch.xpu).device(index):  # restores the current one
            return fp8_dtypes_of_target(driver.active.get_current_target())
    except Exception:  # an older Triton without these APIs, or no driver for the device
        pass
    if device_type == "cuda" and torch.version.hip is None:  # NVIDIA's rule, as Triton applies it
        major, minor = torch.cuda.get_device_capability(index)
        return frozenset({torch.float8_e5m2} | ({torch.float8_e4m3fn} if (major, minor) >= (8, 9) else set()))
    return None


def triton_fp8_dtypes(device: torch.device | str) -> frozenset[torch.dtype] | None:
    """fp8 dtypes Triton converts on ``device``, as its backend for the device's architecture declares
    them; ``None`` where that cannot be learnt (then the backend's own declaration stands)."""
    device = torch.device(device)
    if device.type == "cpu":
        return frozenset({torch.float8_e4m3fn, torch.float8_e5m2})  # the interpreter converts both
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    if device.type not in ("cuda", "xpu"):
        return None
    return _triton_fp8_dtypes(device.type, device.index or 0)


def synchronize(device: torch.device | str) -> None:
    """Wait for all work queued on ``device``."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    torch.accelerator.synchronize(device)


def available_devices() -> list[str]:
    """The devices this process can use: ``cpu``, then each device of the accelerator, if any."""
    devices = ["cpu"]
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        devices += [f"{kind}:{i}" for i in range(torch.accelerator.device_count())]
    return devices


def _missing(kind: str) -> str:
    """Why ``kind`` devices cannot be used here."""
    built = {
        "cuda": torch.backends.cuda.is_built() or torch.version.hip is not None,
        "xpu": hasattr(torch, "xpu") and torch.xpu._is_compiled(),
        "mps": torch.backends.mps.is_built(),
    }.get(kind)
    if built is False:
        return f"this torch build has no {kind.upper()}"
    return f"no {kind} device is visible to this process"


def resolve_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` this process can use; a ``ValueError`` says why not.

    Checked up front so that a missing accelerator is one clear line ("cuda is not available:
    this torch build has no CUDA; devices here: cpu"), not an error from deep inside torch.
    """
    here = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"expected a device such as {here}, got {device!r}") from None
    if dev.type == "cpu":
        return dev
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != dev.type:
        raise ValueError(f"{dev.type} is not available: {_missing(dev.type)}; devices here: {here}")
    if dev.index is not None and dev.index >= torch.accelerator.device_count():
        raise ValueError(f"{dev} is not available: there is no {dev.type} device {dev.index}; devices here: {here}")
    return dev


def default_device() -> torch.device:
    """The current accelerator if there is one, else the CPU."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


# -- memory ------------------------------------------------------------------------------------
# The engine sizes its KV cache from these numbers on accelerators (engine/memory.py); the CPU has
# no figure of its own here and gets a fixed default there.


def _memory_module(device: torch.device):
    """``torch.cuda`` or ``torch.xpu`` when ``device`` is such a device and it is available, else ``None``."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda
    if device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu
    return None


def memory_info(device: torch.device | str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of ``device``'s memory as its driver reports them (other processes'
    use counts against ``free``); ``None`` for the CPU and devices torch cannot ask."""
    device = torch.device(device)
    module = _memory_module(device)
    if module is None or not hasattr(module, "mem_get_info"):
        return None
    free, total = module.mem_get_info(device)
    return int(free), int(total)


def allocator_memory(device: torch.device | str) -> tuple[int, int, int]:
    """``(allocated, reserved, peak allocated)`` bytes of torch's caching allocator on ``device``
    (this process only); zeros for the CPU."""
    device = torch.device(device)
    module = _memory_module(device)
    if module is None:
        return 0, 0, 0
    return (
        int(module.memory_allocated(device)),
        int(module.memory_reserved(device)),
        int(module.max_memory_allocated(device)),
    )


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak for :func:`allocator_memory` (and return cached blocks no tensor uses)."""
    device = torch.device(device)
    module = _memory_module(device)
    if module is not None:
        module.empty_cache()
        module.reset_peak_memory_stats(device)


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


def describe_device(device: torch.device | str) -> dict[str, str]:
    """What a report should say about ``device``: name, architecture, memory, runtime and driver.

    Every field is a string (``"unknown"`` where this machine does not say); read for reports only.
    """
    device = torch.device(device)
    info = {"device": str(device), "name": "unknown", "arch": "unknown", "memory": "unknown"}
    info |= {"runtime": "unknown", "driver": "unknown"}
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device.index if device.index is not None else 0)
        hip = torch.version.hip
        info["name"] = props.name
        info["arch"] = getattr(props, "gcnArchName", "unknown") if hip else f"sm_{props.major}{props.minor}"
        info["memory"] = f"{props.total_memory / 2**30:.1f} GiB"
        info["runtime"] = f"HIP {hip}" if hip else f"CUDA {torch.version.cuda}"
        info["driver"] = _command_output(["rocm-smi", "--showdriverversion"] if hip else _NVIDIA_DRIVER_QUERY)
    elif device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        props = torch.xpu.get_device_properties(device.index if device.index is not None else 0)
        info["name"] = props.name
        info["memory"] = f"{props.total_memory / 2**30:.1f} GiB"
        info["runtime"] = f"XPU (torch {torch.__version__})"
        info["driver"] = str(getattr(props, "driver_version", "unknown"))
    elif device.type == "cpu":
        info["name"] = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
        info["arch"] = platform.machine()
        info["driver"] = "none (CPU)"
        info["runtime"] = "Triton interpreter" if is_triton_interpreter() else "none"
    return info


_NVIDIA_DRIVER_QUERY = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]


def _command_output(argv: list[str]) -> str:
    """The last non-empty line a vendor tool prints (the driver version), or ``"unknown"``."""
    if shutil.which(argv[0]) is None:
        return "unknown"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        return "unknown"
    if argv[0] == "nvidia-smi":
        return lines[0]
    labelled = [line for line in lines if "version" in line.lower() and ":" in line]  # "Driver version: 6.8.5"
    return labelled[0].split(":")[-1].strip() if labelled else "unknown"
