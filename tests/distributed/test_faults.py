"""A rank that raises, dies or hangs makes rank 0's ``generate`` raise (with the rank's traceback
when it had one) in bounded time, every rank process ends, and the LLM refuses further work."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from portattn.engine.llm import LLM
from portattn.engine.parallel.driver import WorkerError
from portattn.models import register_model
from tiny_models import checkpoint

from .conftest import DEVICE, alive, generate, rank_pids
from .faulty import ARCHITECTURE, TARGET


def faulty_checkpoint(root: str, tmp_path, fault: str) -> str:
    path = tmp_path / f"faulty_{fault}"
    shutil.copytree(checkpoint("llama", root), path)
    config = json.loads((path / "config.json").read_text())
    config |= dict(architectures=[ARCHITECTURE], portattn_test_fault=fault)
    (path / "config.json").write_text(json.dumps(config))
    register_model(ARCHITECTURE, TARGET)  # rank 0 passes its registrations to the other ranks
    return str(path)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("raise", r"rank 1 failed:\n(.|\n)*RuntimeError: injected fault on rank 1"),
        ("exit", r"rank 1 exited with code 3"),
    ],
)
def test_failing_rank_raises_its_error(fault, message, ckpt_root, tmp_path):
    llm = LLM(
        faulty_checkpoint(ckpt_root, tmp_path, fault),
        num_pages=32,
        max_model_len=256,
        tensor_parallel_size=2,
        device=DEVICE,
    )
    pids = rank_pids(llm)
    with pytest.raises(WorkerError, match=message):
        generate(llm, [[1, 2, 3]], 4, prompt_logits=False)
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="stopped after an error"):
        generate(llm, [[1, 2, 3]], 4, prompt_logits=False)
    llm.shutdown()  # nothing left to do, and no error


def test_hanging_rank_fails_the_step_after_the_timeout(ckpt_root, tmp_path, monkeypatch):
    monkeypatch.setenv("PORTATTN_TP_TIMEOUT_S", "3")
    llm = LLM(
        faulty_checkpoint(ckpt_root, tmp_path, "hang"),
        num_pages=32,
        max_model_len=256,
        tensor_parallel_size=2,
        device=DEVICE,
    )
    pids = rank_pids(llm)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="no rank reported an error"):
        generate(llm, [[1, 2, 3]], 4, prompt_logits=False)
    assert time.monotonic() - start < 30
    assert not any(alive(pid) for pid in pids)
