"""``portattn generate`` and ``portattn demo`` end to end (in-process), and the flags and ``LLM``
keywords generated from ``EngineConfig`` and ``SamplingParams``."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

import portattn.engine.llm
from portattn.cli import main
from portattn.engine import arguments
from portattn.engine import cli as engine_cli
from portattn.engine.config import EngineConfig
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import checkpoint, hf_reference


def test_generate_prints_transformers_tokens(ckpt_root, capsys):
    path = checkpoint("qwen3", ckpt_root)
    argv = [
        "generate",
        "--model",
        path,
        "--prompt-ids",
        "0,5,9,200",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--temperature",
        "0",
    ]
    argv += ["--page-size", "3", "--attention-backend", "torch", "--max-model-len", "40", "--kv-cache-memory", "200000"]
    assert main([*argv, "--enable-prefix-caching", "--chunked-prefill-size", "3"]) == 0
    want = hf_reference(path, (0, 5, 9, 200), 6)[0]
    assert f"output ids: {want}" in capsys.readouterr().out


def test_demo_runs_and_matches(capsys):
    argv = ["demo", "--families", "llama4", "--page-sizes", "7", "--num-prompts", "2", "--max-tokens", "4"]
    assert main([*argv, "--no-real-model"]) == 0  # the real model's part: tests/models/test_gguf.py
    out = capsys.readouterr().out
    assert "llama4         7           no" in out and "all greedy outputs equal transformers'" in out


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys):
    status = main(["generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("portattn generate: error: expected a Hugging Face checkpoint directory with config.json")
    assert "Traceback" not in err


def _other_value(cls: type, field: dataclasses.Field):
    """A command-line value of ``field`` other than its default (where its type allows one)."""
    kind = arguments.flag_type(cls, field.name)
    choices = field.metadata.get("choices")
    default = None if field.default is dataclasses.MISSING else field.default
    if kind is bool:
        return not default
    if choices:
        return next(c for c in choices if c != default)
    if kind is str:
        return "x" if default is None else default
    return kind(3) if default is None else kind(default) + kind(2)


def _argv(cls: type, values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            argv += [flag, str(value)]
    return argv


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_every_engine_config_field_is_a_flag_and_an_llm_keyword(tmp_path, monkeypatch):
    fields = dataclasses.fields(EngineConfig)
    values = {f.name: _other_value(EngineConfig, f) for f in fields} | {"model": str(tmp_path)}
    values["gpu_memory_utilization"] = 0.5  # in (0, 1]
    values["speculative_config"] = '{"method": "ngram", "num_speculative_tokens": 2}'  # a JSON object
    values["async_scheduling"] = False  # it refuses speculative decoding (given above); its flag below
    given = arguments.given(_parse(_argv(EngineConfig, values)), EngineConfig)
    assert given == values  # each flag, parsed to its field's type
    flag = _parse(["--model", str(tmp_path), "--prompt-ids", "1", "--async-scheduling"])
    assert arguments.given(flag, EngineConfig) == {"model": str(tmp_path), "async_scheduling": True}
    assert all(f.metadata.get("help") for f in fields)

    monkeypatch.setattr(portattn.engine.llm, "build_engine", lambda config: type("Stub", (), {"tokenizer": None})())
    assert LLM(**given).config == EngineConfig(**values)  # each field an LLM keyword, passed through
    params = inspect.signature(LLM).parameters
    assert list(params) == [f.name for f in fields]
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(params[f.name].default == f.default for f in fields[1:])
    assert "\ngpu_memory_utilization: fraction of an accelerator's memory" in LLM.__init__.__doc__


def test_flags_not_given_leave_the_dataclass_defaults(tmp_path):
    args = _parse(["--model", str(tmp_path), "--prompt-ids", "1"])
    assert arguments.given(args, EngineConfig) == {"model": str(tmp_path)}
    assert arguments.given(args, SamplingParams) == {}
    for cls in (EngineConfig, SamplingParams):
        for line, field in zip(arguments.describe(cls).splitlines(), dataclasses.fields(cls)):
            shown = field.default not in (None, dataclasses.MISSING)
            assert line.startswith(f"{field.name}: ") and line.endswith(f" (default: {field.default})") == shown


def test_every_sampling_field_the_command_uses_is_a_flag():
    fields = [f for f in dataclasses.fields(SamplingParams) if f.name not in engine_cli.NOT_FLAGS]
    assert len(fields) == len(dataclasses.fields(SamplingParams)) - len(engine_cli.NOT_FLAGS)
    values = {f.name: _other_value(SamplingParams, f) for f in fields}
    values["top_p"] = values["min_p"] = 0.5  # in (0, 1]
    values["stop"] = "x"  # a flag gives one stop string
    args = _parse(["--model", "m", *_argv(SamplingParams, values)])
    assert SamplingParams(**arguments.given(args, SamplingParams)) == SamplingParams(**values)


def test_a_new_field_gets_its_flag_and_keyword_without_other_edits():
    @dataclasses.dataclass(frozen=True)
    class Future(EngineConfig):
        log_stats: bool = dataclasses.field(default=False, metadata=arguments.doc("log throughput"))
        pipeline_parallel_size: int = dataclasses.field(default=1, metadata=arguments.doc("devices per model"))
        offload_policy: str | None = dataclasses.field(
            default=None, metadata=arguments.doc("where pages go", choices=("cpu", "disk"))
        )

    parser = argparse.ArgumentParser()
    arguments.add_flags(parser, Future)
    args = parser.parse_args(
        ["--model", "m", "--log-stats", "--pipeline-parallel-size", "2", "--offload-policy", "cpu"]
    )
    assert arguments.given(args, Future) == {
        "model": "m",
        "log_stats": True,
        "pipeline_parallel_size": 2,
        "offload_policy": "cpu",
    }
    assert list(arguments.keyword_signature(Future).parameters)[-3:] == [
        "log_stats",
        "pipeline_parallel_size",
        "offload_policy",
    ]


def test_unknown_keywords_and_flags_say_what_is_valid(tmp_path, capsys):
    with pytest.raises(
        TypeError, match=r"expected LLM keyword arguments among \['model', .*'page_size'.*\], got \['page_sise'\]"
    ):
        LLM(tmp_path, page_sise=3)
    with pytest.raises(SystemExit):
        _parse(["--model", "m", "--page-sise", "3"])
    assert "unrecognized arguments: --page-sise 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--prompt-ids", "1"])  # --model has no default
    assert "the following arguments are required: --model" in capsys.readouterr().err


def test_a_field_type_without_a_flag_type_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Odd:
        sizes: list[int] = dataclasses.field(default=None, metadata=arguments.doc("sizes"))

    with pytest.raises(
        TypeError, match=r"expected Odd.sizes annotated with one of bool, int, float, str, got list\[int\]"
    ):
        arguments.add_flags(argparse.ArgumentParser(), Odd)
