"""`portattn check`: passes for the reference backend, and fails for a backend that is wrong."""

from __future__ import annotations

import dataclasses

import pytest

from portattn import cli
from portattn.backends import registry
from portattn.backends.torch_ref import TorchBackend


class WindowBlindBackend(TorchBackend):
    """Claims sliding windows but ignores them: exactly the kind of silent bug check must catch."""

    name = "window_blind"

    def paged_attention(self, q, k_cache, v_cache, metadata, params, out, lse=None):
        params = dataclasses.replace(params, window_left=-1)
        return super().paged_attention(q, k_cache, v_cache, metadata, params, out, lse=lse)


@pytest.fixture
def window_blind(monkeypatch):
    entry = registry._Entry("window_blind", f"{__name__}:WindowBlindBackend")
    monkeypatch.setitem(registry._REGISTRY, "window_blind", entry)
    yield
    registry._CLASSES.pop("window_blind", None)
    registry._INSTANCES.pop("window_blind", None)


def test_check_passes_for_the_reference_backend(capsys):
    status = cli.main(["check", "--backend", "torch", "--dtype", "fp32", "--dtype", "bf16", "--page-size", "3"])
    out = capsys.readouterr().out
    assert status == 0
    assert "FAIL" not in out and "paged_attention   window_left 5" in out
    assert out.strip().endswith("0 failed")


def test_check_fails_for_a_wrong_backend(window_blind, capsys):
    status = cli.main(["check", "--backend", "window_blind", "--dtype", "fp32", "--page-size", "1", "--page-size", "7"])
    out = capsys.readouterr().out
    assert status == 1
    failed = [line for line in out.splitlines() if line.endswith("FAIL")]
    assert failed and all("window" in line for line in failed)
    assert "causal                   window_blind fp32" in out and out.count(" pass") > 5
