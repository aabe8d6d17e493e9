"""`portattn check`: passes for the reference backend, fails for a backend that is wrong (naming the
case and printing a command that reruns it), reports crashes as failures, and writes JSON."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from portattn import cli
from portattn.backends import registry
from portattn.backends.torch_ref import TorchBackend
from portattn.check import FEATURES
from portattn.device import default_device


class WindowBlindBackend(TorchBackend):
    """Claims sliding windows but ignores them: exactly the kind of silent bug check must catch."""

    name = "window_blind"

    def paged_attention(self, q, k_cache, v_cache, metadata, params, out, lse=None):
        params = dataclasses.replace(params, window_left=-1)
        return super().paged_attention(q, k_cache, v_cache, metadata, params, out, lse)


class CrashingMLABackend(TorchBackend):
    """Raises inside MLA decode: a crash is a failed row, and the other rows still run."""

    name = "crashing_mla"

    def mla_decode(self, *args, **kwargs):
        raise RuntimeError("kernel launch failed")


class PagedOnlyBackend(TorchBackend):
    """Declares only paged attention in fp32 without fp8: everything else is skipped, not failed."""

    name = "paged_only"
    capabilities = dataclasses.replace(
        TorchBackend.capabilities,
        ops=frozenset({"paged_attention"}),
        kv_dtypes=frozenset(),
        features=frozenset({"window", "non_causal", "dv_ne_d"}),
    )


@pytest.fixture
def extra_backends(monkeypatch):
    """The test backends registered for one test (``--register`` adds to the same registry)."""
    before = dict(registry._REGISTRY)
    for cls in (CrashingMLABackend, PagedOnlyBackend):
        registry.register_backend(cls.name, f"{__name__}:{cls.__name__}")
    yield
    for name in set(registry._REGISTRY) - set(before):
        del registry._REGISTRY[name]
        registry._CLASSES.pop(name, None)
        registry._INSTANCES.pop(name, None)


def test_check_passes_for_the_reference_backend(capsys):
    status = cli.main(["check", "--backend", "torch", "--dtype", "fp32", "--page-size", "3"])
    out = capsys.readouterr().out
    assert status == 0
    head = out.splitlines()[:3]
    assert head[0].startswith("portattn check ") and f" on {default_device().type}: " in head[0]
    assert "driver " in head[1] and "torch " in head[1] and "triton " in head[1]
    assert "FAIL" not in out and "paged_attention        window_left 5" in out
    for name in ("long decode (split-KV)", "fp8 e5m2 cache", "head dim 256", "MLA fp8 e4m3", "merge 3 parts"):
        assert f" {name} " in out
    assert re.search(r"\n\d+ passed, 0 failed, 0 skipped \(declared unsupported\) in \d+\.\d s$", out.strip())


def test_a_failure_names_its_case_and_its_rerun_command(extra_backends, capsys):
    cases = ["mixed batch (D 64)", "window_left 5", "fp8 e4m3 + window + sinks", "long decode (split-KV)"]
    register = f"window_blind={__name__}:WindowBlindBackend"
    argv = ["check", "--register", register, "--backend", "window_blind", "--dtype", "fp32"]
    argv += ["--page-size", "1", "--page-size", "7"]
    status = cli.main([*argv, *(a for c in cases for a in ("--case", c))])
    out = capsys.readouterr().out
    assert status == 1
    lines = out.splitlines()
    failed = [i for i, line in enumerate(lines) if line.endswith("FAIL")]
    assert [lines[i].split()[1] for i in failed] == ["window_left", "fp8"]  # the two window cases, no other
    assert "mixed batch (D 64)         window_blind fp32" in out and "long decode (split-KV)" in out
    case, repro = lines[failed[0] + 1], lines[failed[0] + 2]
    assert case.startswith("    case: page_size 7, dtype fp32, q_lens [1, 1, 7, 2, 5, 19], k_lens [1, 6, 7, 8, 23, 19]")
    assert "head_dim 64" in case and "window_left=5" in case and "seed " in case
    device = default_device().type
    rerun_argv = f"check --register {register} --device {device} --backend window_blind --dtype fp32 --page-size 7"
    assert repro == f"    repro: portattn {rerun_argv} --case 'window_left 5'"  # the worse of the two page sizes

    # The printed command reruns exactly that case, and fails again.
    assert cli.main(shlex.split(repro.removeprefix("    repro: portattn "))) == 1
    rerun = capsys.readouterr().out.splitlines()
    assert [line for line in rerun if line.endswith(("pass", "FAIL"))] == [lines[failed[0]]]


def test_crashes_fail_their_rows_and_unsupported_cases_are_skipped(extra_backends, capsys):
    argv = ["check", "--dtype", "fp32", "--page-size", "5", "--case", "MLA 32 + 16, H 5", "--case", "Dv != D"]
    assert cli.main([*argv, "--backend", "crashing_mla"]) == 1
    out = capsys.readouterr().out
    assert "paged_attention        Dv != D                    crashing_mla fp32" in out and " pass" in out
    assert "    error: RuntimeError: kernel launch failed" in out
    assert cli.main([*argv, "--case", "sinks", "--case", "fp8 e4m3 cache", "--backend", "paged_only"]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 0 failed, 3 skipped (declared unsupported) in " in out
    # Each skipped case is a row of the table, with the backend's reason.
    skip = "paged_attention        sinks                      paged_only fp32           -          -  skip"
    assert f"{skip} (does not support attention sinks)" in out
    assert "MLA 32 + 16, H 5           paged_only fp32           -          -  skip (does not support the mla" in out


def test_json_output(extra_backends, tmp_path, capsys):
    argv = ["check", "--register", f"window_blind={__name__}:WindowBlindBackend", "--backend", "torch"]
    argv += ["--backend", "window_blind", "--dtype", "fp32", "--page-size", "3"]
    assert cli.main([*argv, "--case", "window_left 5", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)  # the JSON alone on stdout
    env = doc["environment"]
    assert {"device", "name", "driver", "runtime", "torch", "triton", "python", "backends"} <= set(env)
    assert env["backends"] == ["torch", "window_blind"] and env["page_sizes"] == [3]
    ok, bad = doc["rows"]
    assert ok["ok"] and ok["backend"] == "torch" and "repro" not in ok
    assert not bad["ok"] and bad["case"]["kwargs"] == {"window_left": 5} and bad["repro"].endswith("'window_left 5'")
    assert bad["page_sizes"] == [dict(page_size=3, max_error=bad["max_error"], tolerance=bad["tolerance"], ok=False)]
    summary = doc["summary"]
    assert {k: summary[k] for k in ("passed", "failed", "skipped", "required", "ok")} == {
        "passed": 1,
        "failed": 1,
        "skipped": 0,
        "required": {},
        "ok": False,
    }
    assert isinstance(summary["seconds"], float)
    path = tmp_path / "check.json"
    argv = ["check", "--backend", "torch", "--dtype", "fp32", "--page-size", "3", "--case", "sinks"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    assert "1 passed" in capsys.readouterr().out  # the table still prints
    assert json.loads(path.read_text())["rows"][0]["feature"] == "sinks"


def test_case_names_and_bad_flags(extra_backends, capsys):
    assert cli.main(["check", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(FEATURES) and listed[0].split()[1:4] == ["mixed", "batch", "(D"]
    assert listed[[f.name for f in FEATURES].index("sinks + window (D 64)")].endswith("paged_attention sinks window")
    assert cli.main(["check", "--case", "no such case"]) == 2
    assert "expected --case in [" in capsys.readouterr().err
    assert cli.main(["check", "--backend", "nope"]) == 2
    assert "expected --backend in [" in capsys.readouterr().err
    assert cli.main(["check", "--register", "x=no_such_module:B"]) == 2
    assert "--register x=no_such_module:B: cannot import" in capsys.readouterr().err
    assert cli.main(["check", "--register", f"other={__name__}:WindowBlindBackend"]) == 2
    assert "WindowBlindBackend.name == 'other'" in capsys.readouterr().err


def test_a_check_where_no_case_ran_fails(extra_backends, capsys):
    argv = ["check", "--dtype", "fp32", "--page-size", "5", "--case", "sinks", "--backend", "paged_only"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "0 passed, 0 failed, 1 skipped" in out and "FAIL: no case ran" in out
    assert cli.main([*argv, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["summary"]["ok"] is False


def test_required_features_need_a_passing_case(extra_backends, tmp_path, capsys):
    argv = ["check", "--dtype", "fp32", "--page-size", "3", "--case", "sinks", "--case", "window_left 5"]
    assert cli.main([*argv, "--backend", "torch", "--require", "sinks,window", "--require", "paged_attention"]) == 0
    assert "FAIL" not in capsys.readouterr().out
    # window_blind's window row fails; paged_only skips sinks: neither feature has a passing case.
    register = f"window_blind={__name__}:WindowBlindBackend"
    argv += ["--register", register, "--backend", "window_blind", "--json", str(tmp_path / "c.json")]
    assert cli.main([*argv, "--require", "window"]) == 1
    assert "FAIL: no passing case for --require window" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["summary"]["required"] == {"window": False}
    assert cli.main(["check", "--require", "windows"]) == 2
    assert "expected --require of ['alibi', 'chunk'," in capsys.readouterr().err


def test_a_closed_pipe_ends_the_check_quietly():
    """`portattn check | head`: no traceback or broken-pipe message, the status of a SIGPIPE death."""
    src = Path(__file__).resolve().parents[2] / "src"
    script = (
        f"set -o pipefail; PYTHONPATH={src} {sys.executable} -m portattn.cli check --backend torch --dtype fp32 "
        "--page-size 3 | head -n 2 >/dev/null; echo status ${PIPESTATUS[0]} >&2"
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stderr.strip() == "status 141", done.stderr
