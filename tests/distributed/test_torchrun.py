"""The multi-node path on one machine: two ``torchrun`` invocations (``--nnodes 2``, node ranks 0 and
1, one process each) meet on 127.0.0.1 and run ``portattn generate --tensor-parallel-size 2``; rank 0
prints the tokens one process computes, and both invocations exit 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from portattn.engine.llm import LLM
from tiny_models import checkpoint

from .conftest import DEVICE, generate

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(node_rank: int, port: int, path: str) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank)]
    torchrun += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    generate_args = ["--model", path, "--device", DEVICE, "--prompt-ids", ",".join(map(str, PROMPT))]
    generate_args += ["--max-tokens", "6", "--ignore-eos", "--num-pages", "32", "--max-model-len", "256"]
    generate_args += ["--tensor-parallel-size", "2", "--temperature", "0"]
    return [*torchrun, "-m", "portattn.cli", "generate", *generate_args]


def test_two_torchrun_nodes_equal_one_process(ckpt_root):
    path = checkpoint("qwen3", ckpt_root)
    want = generate(LLM(path, num_pages=32, max_model_len=256, device=DEVICE), [PROMPT], 6, prompt_logits=False)[
        0
    ].token_ids
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    nodes = []
    for node_rank in (0, 1):
        if DEVICE != "cpu":  # two "nodes" of one host: each sees its own device as its device 0
            env = dict(env, CUDA_VISIBLE_DEVICES=str(node_rank), ZE_AFFINITY_MASK=str(node_rank))
        command = node_command(node_rank, port, path)
        nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    except subprocess.TimeoutExpired:  # what each node printed, to say where they stopped
        for node in nodes:
            node.kill()
        tails = [f"node {rank}: {node.communicate()[1][-1500:]}" for rank, node in enumerate(nodes)]
        pytest.fail(f"the two torchrun nodes (port {port}) did not finish in 240 s:\n" + "\n".join(tails))
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert f"output ids: {want}" in outputs[0][0]
    assert "output ids" not in outputs[1][0]  # rank 1 served rank 0's steps and printed nothing
