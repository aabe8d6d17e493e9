"""A server that speculates exposes vLLM's speculative-decoding counters on ``/metrics``, equal to what
the engine counted (``LLM.get_metrics()`` reads the same counters)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from portattn.engine.metrics import engine_metrics

from .conftest import request, running_server, tiny_checkpoint, wait_until

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def test_metrics_expose_the_speculative_decoding_counters(model_root):
    with running_server(tiny_checkpoint(model_root), speculative_config=SPEC) as (url, app):
        body = {"prompt": "the cat the cat the cat the", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert request(url + "/v1/completions", "POST", body)[0] == 200
        engine = app.state.server.engine
        assert wait_until(lambda: engine.stats.spec_decode is not None and not engine.stats.running)
        _, text, _ = request(url + "/metrics")
    values = {}
    for line in text.splitlines():
        if line.startswith("portattn:spec_decode"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0] + ("[" + name.split('position="')[1][0] + "]" if "position" in name else "")] = (
                float(value)
            )
    stats = engine.engine.speculator.stats
    assert stats.num_drafts > 0
    assert values["portattn:spec_decode_num_drafts_total"] == stats.num_drafts
    assert values["portattn:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert values["portattn:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    per_pos = [values[f"portattn:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(3)]
    assert per_pos == stats.accepted_per_pos
    by_name = {m.name: m for m in engine_metrics(engine.engine)}
    assert by_name["portattn:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens
    assert by_name["portattn:spec_decode_num_accepted_tokens_per_pos"].values == stats.accepted_per_pos
    assert by_name["portattn:generation_tokens"].value == engine.engine.num_generated_tokens >= 12


def spec_lines(url: str) -> list[str]:
    _, text, _ = request(url + "/metrics")
    counters = ("portattn:spec_decode", "portattn:generation_tokens_total")
    return sorted(line for line in text.splitlines() if line.startswith(counters) and "_created" not in line)


def test_the_engine_process_exposes_the_same_counters(model_root):
    """The engine in a process of its own (the default on a GPU) sends the counters with its statistics:
    ``/metrics`` shows what the engine on the server's thread shows for the same greedy request."""
    body = {"prompt": "the cat the cat the cat the", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    lines = []
    for engine_process in (False, True):
        model = tiny_checkpoint(model_root)
        with running_server(model, speculative_config=SPEC, engine_process=engine_process) as (url, app):
            assert request(url + "/v1/completions", "POST", body)[0] == 200
            engine = app.state.server.engine
            # the engine process's statistics follow its steps (at most every 50 ms, and when it is idle)
            assert wait_until(lambda e=engine: e.stats.generation_tokens >= body["max_tokens"] and not e.stats.running)
            lines.append(spec_lines(url))
    assert any(
        line.startswith("portattn:spec_decode_num_drafts_total") and not line.endswith(" 0.0") for line in lines[0]
    )
    assert lines[1] == lines[0]
