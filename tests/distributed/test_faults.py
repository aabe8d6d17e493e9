"""A rank that raises, dies, hangs or stops makes rank 0's ``generate`` raise (with the rank's
traceback when it had one, else naming the rank that stopped answering) in bounded time, every
rank process ends, and the LLM refuses further work."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.parallel.driver import WorkerError
from portattn.testing import IMAGE_PAD, PATCH_DIM, VISION_END, VISION_START
from tiny_models import checkpoint

from .conftest import DEVICE, alive, generate, rank_pids
from .faulty import faulty_checkpoint


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
    with pytest.raises(WorkerError, match="rank 1 stopped answering: it is alive but still runs the step"):
        generate(llm, [[1, 2, 3]], 4, prompt_logits=False)
    assert time.monotonic() - start < 30
    assert not any(alive(pid) for pid in pids)


def large_image_prompt(side: int) -> dict:
    """A Qwen2.5-VL prompt with one ``side x side``-patch image: ``side**2 * PATCH_DIM`` float32 pixels."""
    pixels = torch.randn(side * side, PATCH_DIM)  # [t*h*w, PATCH_DIM]
    image = [VISION_START, *[IMAGE_PAD] * (side * side // 4), VISION_END]
    data = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}
    return {"prompt_token_ids": [1, 2, *image, 3], "multi_modal_data": data}


def test_a_stopped_rank_fails_the_broadcast_of_a_large_step(ckpt_root, monkeypatch):
    """Rank 1's process is stopped (it neither reads nor dies) while rank 0 broadcasts a step with a
    6 MB image, more than the sockets buffer: rank 0 gives up after the timeout and names rank 1."""
    monkeypatch.setenv("PORTATTN_TP_TIMEOUT_S", "3")
    side = 128  # 16384 patches of 96 float32: 6.3 MB of pixels, 4096 image tokens
    pool = dict(page_size=64, num_pages=72, max_model_len=4160, allow_long_max_model_len=True)
    llm = LLM(checkpoint("qwen2_5_vl", ckpt_root), **pool, tensor_parallel_size=2, device=DEVICE)
    pids = rank_pids(llm)
    os.kill(pids[0], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 stopped answering: no sign of life"):
        generate(llm, [large_image_prompt(side)], 1, prompt_logits=False)
    assert time.monotonic() - start < 30
    assert not any(alive(pid) for pid in pids)
