"""``portattn generate`` and ``portattn demo`` end to end (in-process)."""

from __future__ import annotations

from portattn.cli import main

from .conftest import checkpoint, hf_reference


def test_generate_prints_transformers_tokens(ckpt_root, capsys):
    path = checkpoint("qwen3", ckpt_root)
    argv = ["generate", "--model", path, "--prompt-ids", "0,5,9,200", "--max-tokens", "6", "--ignore-eos"]
    assert main([*argv, "--page-size", "3", "--attention-backend", "torch"]) == 0
    want = hf_reference(path, (0, 5, 9, 200), 6)[0]
    assert f"output ids: {want}" in capsys.readouterr().out


def test_demo_runs_and_matches(capsys):
    assert main(["demo", "--families", "llama4", "--page-sizes", "7", "--num-prompts", "2", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "llama4         7           no" in out and "all greedy outputs equal transformers'" in out


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys):
    status = main(["generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("portattn generate: error: expected a Hugging Face checkpoint directory with config.json")
    assert "Traceback" not in err
