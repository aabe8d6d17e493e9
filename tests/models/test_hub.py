"""A Hugging Face model id resolves through the local Hugging Face cache (never the network), and a
missing one says how to fetch it."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

from portattn.cli import main
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.models.hub import resolve_checkpoint
from portattn.testing import save_tiny_chat_checkpoint


def cache_snapshot(cache: Path, repo_id: str, source: str | None, revision: str = "0123abcd") -> Path:
    """The layout `hf download` leaves: refs/main names a snapshot folder holding the files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    if source is None:
        snapshot.mkdir(parents=True)
    else:
        shutil.copytree(source, snapshot)
    return snapshot


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> str:
    return save_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_model_id_in_the_cache_loads_and_generates(chat_checkpoint, hf_cache):
    snapshot = cache_snapshot(hf_cache, "tiny-org/Tiny-Chat-1B", chat_checkpoint)
    llm = LLM("tiny-org/Tiny-Chat-1B", device="cpu", max_model_len=128)
    assert llm.config.model == str(snapshot)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    out = llm.generate("Hello", greedy, use_tqdm=False)[0]
    want = LLM(chat_checkpoint, device="cpu", max_model_len=128).generate("Hello", greedy, use_tqdm=False)[0]
    assert out.token_ids == want.token_ids and out.text == want.text


def test_a_missing_model_id_says_how_to_fetch_it(hf_cache, capsys):
    with pytest.raises(ValueError) as err:
        LLM("meta-llama/Llama-3.1-8B-Instruct")
    message = str(err.value)
    assert "expected a checkpoint directory or a Hugging Face model id in the local Hugging Face cache" in message
    assert "`hf download meta-llama/Llama-3.1-8B-Instruct`" in message
    assert "`huggingface-cli download meta-llama/Llama-3.1-8B-Instruct`" in message
    assert main(["generate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--prompt", "Hi"]) == 2
    assert "hf download meta-llama/Llama-3.1-8B-Instruct" in capsys.readouterr().err


def test_a_partial_snapshot_and_local_directories(chat_checkpoint, hf_cache, tmp_path, monkeypatch):
    cache_snapshot(hf_cache, "org/partial", None)
    with pytest.raises(ValueError, match=r"expected config.json in the cached snapshot of 'org/partial'"):
        resolve_checkpoint("org/partial")
    # A directory of that name here wins over the cache; paths and plain names pass through.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(chat_checkpoint, tmp_path / "org" / "partial")
    assert resolve_checkpoint("org/partial") == "org/partial"
    assert resolve_checkpoint("/no/such/dir") == "/no/such/dir"
    assert resolve_checkpoint("gpt2") == "gpt2"
