"""Backend registry: selection order, capability errors, logging once."""

from __future__ import annotations

import logging

import pytest
import torch

import portattn
from portattn import UnsupportedFeatureError
from portattn.backends import registry
from portattn.backends.base import Capabilities, Request
from portattn.backends.torch_ref import TorchBackend
from portattn.testing import make_paged_case


class LimitedBackend(TorchBackend):
    """Fast on paper, but only plain causal paged attention in fp32 with head dim 64."""

    name = "limited"
    priority = 100
    capabilities = Capabilities(
        ops=frozenset({"paged_attention"}), dtypes=frozenset({torch.float32}), head_dims=frozenset({64})
    )


@pytest.fixture
def limited(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "limited", registry._Entry("limited", f"{__name__}:LimitedBackend"))
    monkeypatch.setattr(registry, "_LOGGED", set())
    yield
    registry._CLASSES.pop("limited", None)
    registry._INSTANCES.pop("limited", None)


def request(**kw):
    base = dict(op="paged_attention", device_type="cpu", dtype=torch.float32, head_dim=64, features=frozenset())
    return Request(**{**base, **kw})


def test_auto_picks_the_highest_priority_backend_that_covers_the_call(limited):
    assert registry.select_backend("attention", "auto", request()).name == "limited"
    assert registry.select_backend("attention", "auto", request(features=frozenset({"window"}))).name == "torch"
    assert registry.select_backend("attention", "auto", request(dtype=torch.float16)).name == "torch"
    assert registry.select_backend("mm", "auto", request(op="varlen_attention")).name != "limited"


def test_auto_never_picks_an_interpreted_backend(monkeypatch):
    # Triton under TRITON_INTERPRET=1 runs on the CPU for tests, far slower than the torch backend.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.select_backend("attention", "auto", request(features=frozenset({"window"}))).name == "torch"


@pytest.mark.parametrize(
    ("req", "what"),
    [
        (request(features=frozenset({"sinks"})), "attention sinks"),
        (request(features=frozenset({"chunk", "window"})), "chunked local attention"),
        (request(op="varlen_attention"), "the varlen_attention op"),
        (request(dtype=torch.bfloat16), "dtype torch.bfloat16"),
        (request(head_dim=80), "head dim 80"),
    ],
)
def test_missing_feature_names_the_backends_that_have_it(limited, req, what):
    with pytest.raises(
        UnsupportedFeatureError, match=f"'limited' does not support {what}.*; backends that do: 'torch'"
    ):
        registry.select_backend("attention", "limited", req)


def test_unsupported_feature_error_is_a_value_error_from_the_public_op(limited):
    case = make_paged_case([1], [4], page_size=2)
    with pytest.raises(ValueError, match="does not support a sliding window"):
        portattn.paged_attention(**case.inputs(), window_left=2, backend="limited")


def test_environment_variable_then_explicit_name(limited, monkeypatch):
    monkeypatch.setenv("PORTATTN_ATTENTION_BACKEND", "torch")
    assert registry.resolve_name("attention") == ("torch", "PORTATTN_ATTENTION_BACKEND")
    assert registry.select_backend("attention", None, request()).name == "torch"
    assert registry.select_backend("attention", "limited", request()).name == "limited"
    # The mm kind reads its own variable.
    assert registry.resolve_name("mm") == ("auto", "auto")
    monkeypatch.setenv("PORTATTN_MM_ATTENTION_BACKEND", "limited")
    assert registry.resolve_name("mm") == ("limited", "PORTATTN_MM_ATTENTION_BACKEND")


def test_unknown_names_and_kinds():
    with pytest.raises(ValueError, match=r"expected an attention backend in \['torch'.*'auto'\], got 'nope'"):
        registry.select_backend("attention", "nope", request())
    with pytest.raises(ValueError, match="expected a backend kind in"):
        registry.resolve_name("vision")


def test_choice_is_logged_once(limited, caplog):
    with caplog.at_level(logging.INFO, logger="portattn"):
        for _ in range(3):
            registry.select_backend("attention", "auto", request())
    assert [r.getMessage() for r in caplog.records] == ["attention backend: limited (auto)"]


def test_register_rejects_a_conflicting_target():
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend("torch", "somewhere:Else")
