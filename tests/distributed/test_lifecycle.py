"""Start and stop: shutdown leaves no rank process behind, a second LLM works in the same process,
the ranks end with rank 0's process (interpreter exit without a shutdown, or rank 0 killed), and
head counts that do not divide fail at start-up with the numbers (and no process left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from portattn.engine.llm import LLM
from tiny_models import checkpoint

from .conftest import DEVICE, alive, children_of, generate, rank_pids

PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


def test_shutdown_then_a_second_llm(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    want = [
        out.token_ids
        for out in generate(LLM(path, num_pages=32, max_model_len=256, device=DEVICE), PROMPTS, 6, prompt_logits=False)
    ]
    for _ in range(2):
        llm = LLM(path, num_pages=32, max_model_len=256, tensor_parallel_size=2, device=DEVICE)
        pids = rank_pids(llm)
        assert all(alive(pid) for pid in pids)
        assert [out.token_ids for out in generate(llm, PROMPTS, 6, prompt_logits=False)] == want
        llm.shutdown()
        llm.shutdown()  # a second call does nothing
        assert not any(alive(pid) for pid in pids)
        assert children_of(os.getpid()) == []
        with pytest.raises(RuntimeError, match="shut down"):
            generate(llm, PROMPTS, 2, prompt_logits=False)


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_ranks_end_with_rank_0s_process(end, ckpt_root):
    """At interpreter exit (the LLM never shut down) the ranks are told to stop; when rank 0's
    process is killed outright, they notice and exit by themselves."""
    script = textwrap.dedent(
        f"""
        import os, signal
        import portattn
        pool = dict(num_pages=32, max_model_len=256)
        llm = portattn.LLM({checkpoint("llama", ckpt_root)!r}, **pool, tensor_parallel_size=2, device={DEVICE!r})
        params = portattn.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
        print("pids", *[p.pid for p in llm.engine.parallel.processes], flush=True)
        print("tokens", *out[0].token_ids, flush=True)
        if {end!r} == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == (0 if end == "exit" else -signal.SIGKILL), done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert len(lines["tokens"].split()) == 3
    pids = [int(pid) for pid in lines["pids"].split()]
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and not any(alive(pid) for pid in pids)


def test_heads_that_do_not_divide_fail_at_start_up(ckpt_root):
    with pytest.raises(ValueError, match=r"num_attention_heads divisible by tensor_parallel_size 3, got 4"):
        LLM(checkpoint("llama", ckpt_root), num_pages=32, max_model_len=256, tensor_parallel_size=3, device=DEVICE)
    assert children_of(os.getpid()) == []
