"""Compiling Triton kernels in worker processes (``kernels/triton/compile_workers.py``) for the warm-up's
compile-ahead (``compile_ahead._Compiles``), without a GPU: kernels compiled for sm_90 (ptxas included).

The compiling side runs in a fresh process without Triton's interpreter (``compile_workers_scenarios.py``:
a process that ran interpreted kernels cannot compile for a GPU). What is checked: a worker's compile
lands in the Triton cache, so that Triton's own compile in the parent, through the compile mode's
closure, is a cache hit; workers are spawned only at the first compile the cache does not hold and take
compiles once ready; kernels the workers cannot import by name, and workers that died, leave the compile
to the parent, which still compiles it; the cache check agrees with what a compile wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
if not hasattr(triton, "AsyncCompileMode"):
    pytest.skip(f"triton {triton.__version__} has no AsyncCompileMode", allow_module_level=True)
if shutil.which("ptxas") is None and not hasattr(triton.knobs, "nvidia"):
    pytest.skip("no ptxas to compile for sm_90", allow_module_level=True)

from portattn.kernels.triton import compile_ahead  # noqa: E402
from portattn.kernels.triton.compile_workers import CompileWorkers  # noqa: E402

TESTS = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def scenarios():
    """Every scenario of ``compile_workers_scenarios.py``, run once in a fresh process: its findings."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), env.get("PYTHONPATH", "")])
    code = "from kernels import compile_workers_scenarios as s; s.main()"
    names = ["worker_compiles", "local_kernel_compiled_here", "dead_workers", "lazy_start", "cache_check"]
    done = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_compiles_into_the_cache_that_the_parent_then_reads(scenarios):
    found = scenarios["worker_compiles"]
    assert found["num_compiled"] == 1
    assert found["compiled_here"] == [["scale_kernel", True]]  # the parent's compile: a hit in the cache
    assert found["seen"] == [["scale_kernel", "scale_kernel"]]  # on_compile's callbacks hear of the worker's
    assert found["name"] == "scale_kernel" and found["ptx_loads"]


def test_a_kernel_the_workers_cannot_import_is_compiled_by_the_parent(scenarios):
    found = scenarios["local_kernel_compiled_here"]
    assert found["num_compiled"] == 0 and found["num_alive"] == 1
    assert found["compiled_here"] == [["local_kernel", False]]  # compiled here, not found in the cache
    assert found["name"] == "local_kernel"


def test_a_dead_worker_is_dropped_and_the_others_or_the_parent_compile(scenarios):
    found = scenarios["dead_workers"]
    assert found["alive_after_one"] == 1 and found["num_alive"] == 0 and found["num_compiled"] == 2
    assert found["compiled_here"] == [["scale_kernel", True], ["scale_kernel", True], ["scale_kernel", False]]
    assert found["names"] == ["scale_kernel"] * 3


def test_workers_start_at_the_first_compile_the_cache_does_not_hold(scenarios):
    found = scenarios["lazy_start"]
    assert found["spawned_at_first"] == 0 and found["spawned_after_a_hit"] == 0  # a hit spawns nothing
    assert found["spawned_after_a_miss"] == 2 and found["compiled_after_a_miss"] == 0  # none ready yet
    assert found["ready"] and found["compiled_when_ready"] == 1
    hits = [hit for _, hit in found["compiled_here"]]
    assert hits == [False, True, False, True]  # here; a hit; here (no worker ready); the worker's, read here


def test_the_cache_check_finds_what_a_compile_wrote(scenarios):
    found = scenarios["cache_check"]
    assert not found["before"] and found["after"] and not found["other_variant"] and not found["not_a_source"]


def test_the_compile_job_is_read_from_the_closure_triton_hands_over():
    src, target, options = object(), object(), type("Options", (), {})()
    options.num_warps = 4

    def async_compile():
        return src, target, options

    assert compile_ahead._compile_job(async_compile) == (src, target, {"num_warps": 4})
    assert compile_ahead._compile_job(lambda: None) is None  # not such a closure: the thread compiles alone
    assert compile_ahead._compile_job(print) is None


def test_workers_start_only_for_a_cuda_device_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(compile_ahead, "_workers", [None])
    assert not compile_ahead.start_workers(torch.device("cpu"))
    monkeypatch.setattr(compile_ahead, "available", lambda: True)
    monkeypatch.setenv("PORTATTN_COMPILE_WORKERS", "0")
    assert not compile_ahead.start_workers(torch.device("cuda", 0))
    assert compile_ahead._workers[0] is None
    monkeypatch.setenv("PORTATTN_COMPILE_WORKERS", "1")
    made = []

    class Workers:  # records what start_workers does with them
        def __init__(self, count):
            self.count, self.spawned = count, False
            made.append(self)

        def start(self):
            self.spawned = True

    monkeypatch.setattr("portattn.kernels.triton.compile_workers.CompileWorkers", Workers)
    cached = [True]
    monkeypatch.setattr("portattn.kernels.triton.compile_workers.cache_holds_kernel", lambda *names: cached[0])
    assert compile_ahead.start_workers(torch.device("cuda", 0), 3) and made[0].count == 3
    assert not made[0].spawned  # the cache holds the attention kernel: spawned at the first miss
    assert not compile_ahead.start_workers(torch.device("cuda", 0), 3) and len(made) == 1  # not started twice
    monkeypatch.setattr(compile_ahead, "_workers", [None])
    cached[0] = False  # a fresh cache: spawned at once, to import while the weights load
    assert compile_ahead.start_workers(torch.device("cuda", 0), 3) and made[1].spawned
    monkeypatch.setattr(compile_ahead, "_workers", [None])


def test_a_fresh_cache_is_one_without_the_kernel(monkeypatch, tmp_path):
    from portattn.kernels.triton.compile_workers import cache_holds_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "missing"))
    assert not cache_holds_kernel("attention_fwd_kernel")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert not cache_holds_kernel("attention_fwd_kernel")  # empty
    (tmp_path / "KEY1").mkdir()
    (tmp_path / "KEY1" / "attention_fwd_kernel_v2.json").write_text("{}")
    (tmp_path / "KEY1" / "add_rmsnorm_kernel.json").write_text("{}")
    assert not cache_holds_kernel("attention_fwd_kernel")  # other kernels only
    assert cache_holds_kernel("attention_fwd_kernel", "add_rmsnorm_kernel")  # one of them
    (tmp_path / "KEY2").mkdir()
    (tmp_path / "KEY2" / "attention_fwd_kernel.json").write_text("{}")
    assert cache_holds_kernel("attention_fwd_kernel")


@pytest.mark.parametrize("wait", [True, False])
def test_closed_workers_exit_and_refuse_jobs(wait):
    """Closing ends every worker (at once, or with ``wait`` False on a thread while the caller goes on)."""
    workers = CompileWorkers(2)
    assert workers.wait_ready(timeout=120) and workers.num_ready == 2
    procs = list(workers._procs)
    workers.close(wait=wait)
    assert workers.compile(None, None, {}) is None
    if wait:
        assert all(p.poll() is not None for p in procs)
    deadline = time.monotonic() + 30
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.poll() is not None for p in procs)
    workers.close()  # again: nothing to do
