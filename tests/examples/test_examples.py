"""The scripts of examples/ run as a user runs them, on a tiny chat checkpoint: the offline one in a
fresh interpreter (which also shows the engine's INFO start-up line without any logging set-up), the
others in this process (the serving client against a server on a thread)."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing import save_tiny_chat_checkpoint
from server.conftest import running_server

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> str:
    return save_tiny_chat_checkpoint(tmp_path_factory.mktemp("examples") / "tiny-chat")


def run_example(name: str, *argv: str) -> None:
    sys_argv = sys.argv
    sys.argv = [str(EXAMPLES / name), *argv]
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        sys.argv = sys_argv


def test_offline_generate(chat_checkpoint):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PORTATTN_CONFIGURE_LOGGING", None)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "offline_generate.py"), chat_checkpoint],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    want = LLM(chat_checkpoint, max_model_len=1024).generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
    )[0]
    assert f"'The capital of France is' -> {want.outputs[0].text!r} (" in done.stdout
    assert re.search(r"choice 1: .* \(finish: (length|stop)\)", done.stdout)
    # The start-up line, with no logging set up by the script.
    assert re.search(r"portattn: loaded \S+ on cpu in float32: KV cache [\d,]+ tokens .* concurrency", done.stderr)
    assert "Processed prompts: 100%" in done.stderr


def test_chat(chat_checkpoint, capsys):
    run_example("chat.py", chat_checkpoint)
    out = capsys.readouterr().out.splitlines()
    llm = LLM(chat_checkpoint, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    conversation = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    reply = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And paged attention?"}]
    streamed = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    assert out == [f"assistant: {reply!r}", f"assistant (streamed): {streamed}"]


def test_serving_client(chat_checkpoint, capsys):
    pytest.importorskip("openai")
    with running_server(chat_checkpoint, served_model_name="m") as (url, _):
        run_example("serving_client.py", url + "/v1")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "model: m"
    assert re.fullmatch(r"completion: '.*' \(\d+ tokens\)", out[1]) and out[2].startswith("chat (streamed): ")
