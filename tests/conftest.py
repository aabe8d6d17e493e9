"""Shared test set-up: Triton runs through its CPU interpreter when no GPU is present."""

from __future__ import annotations

import os

import torch

# The engine runs on the CPU in the tests unless a test names a device (the parity tests take
# PORTATTN_TEST_ENGINE_DEVICE): device="auto" would pick a GPU where there is one.
os.environ.setdefault("PORTATTN_DEVICE", "cpu")

if not torch.accelerator.is_available():
    # Must be set before any @triton.jit function is defined, i.e. before kernels are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from portattn.backends.registry import available_backends, backend_class
from portattn.device import default_device, is_triton_interpreter
from portattn.testing import max_error, tolerance

DEVICE = default_device()
BACKENDS = available_backends(DEVICE)


def dtypes_for(backend: str) -> list[torch.dtype]:
    """dtypes a backend is tested in here: the interpreter computes bf16 dot products wrongly."""
    if backend == "triton" and is_triton_interpreter():
        return [torch.float32, torch.float16]
    return [torch.float32, torch.float16, torch.bfloat16]


def backend_dtype_params(op: str) -> list:
    """(backend, dtype) pairs for every backend here that implements ``op``."""
    return [
        pytest.param(b, dt, id=f"{b}-{str(dt).removeprefix('torch.')}")
        for b in BACKENDS
        if backend_class(b).capabilities.supports("op", op)
        for dt in dtypes_for(b)
    ]


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` is in ``dtype`` and within :func:`~portattn.testing.tolerance` of the float64 reference
    ``ref`` (``lowp``: the same reference computed in ``dtype``)."""
    err, tol = max_error(out, ref), tolerance(ref, lowp, dtype)
    assert out.dtype == dtype
    assert err <= tol, f"max error {err:.3e} > tolerance {tol:.3e}"


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def pytest_collection_modifyitems(config, items):
    """Mark every test with its folder (``ops``, ``engine``, ...): the suites ``scripts/gpu.sh``
    selects with ``-m``, derived from the tree rather than listed by hand."""
    root = config.rootpath / "tests"
    for item in items:
        parts = item.path.relative_to(root).parts
        if len(parts) > 1:
            item.add_marker(parts[0])
