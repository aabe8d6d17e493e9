"""The speculative-decoding benchmark on the tiny chat checkpoint, on the CPU: every (configuration,
prompt set, batch size) measured, n-gram and draft-model answers equal to plain decoding's (float32),
a draft equal to the target accepting every proposal, and the JSON the lead's H200 run commits."""

from __future__ import annotations

import json

from benchmarks import spec_decode as bench
from portattn.testing.chat import save_tiny_chat_checkpoint


def test_spec_decode_benchmark_on_a_tiny_checkpoint(tmp_path, capsys):
    path = save_tiny_chat_checkpoint(tmp_path / "chat")
    out = tmp_path / "spec.json"
    argv = ["--model", path, "--draft-model", path, "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "3"]
    argv += ["--prompts-per-set", "2", "--output-len", "6", "--max-model-len", "1024", "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    runs = {(r["config"], r["set"], r["batch_size"]): r for r in result["runs"]}
    assert set(runs) == {(c, s, b) for c in ("plain", "ngram", "draft") for s in ("repetitive", "chat") for b in (1, 3)}
    for (config, _, batch), r in runs.items():
        assert r["prompts"] == (2 if batch == 1 else 3) and 0 < r["output_tokens"] <= 6 * r["prompts"]
        assert r["tokens_per_s"] == r["output_tokens"] / r["seconds"]
        if config != "plain":
            assert r["same_as_plain"] == r["prompts"]
            assert r["output_tokens"] == runs[("plain", *_key(r))]["output_tokens"]
        if config == "draft":
            assert r["acceptance_rate"] == 1.0
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    table = capsys.readouterr().out
    assert "speedup" in table and len(table.splitlines()) == 1 + len(runs)


def _key(run: dict) -> tuple[str, int]:
    return run["set"], run["batch_size"]
