"""What rank 0's process registered reaches every rank: an out-of-tree attention backend registered
in the parent (through the helper behind ``--register``) runs on both ranks at TP=2 on gloo and
gives TP=1's tokens and logits; ``portattn generate`` and ``serve`` take ``--register``."""

from __future__ import annotations

import pytest

from portattn import cli
from portattn.backends import registry
from portattn.engine.llm import LLM
from tiny_models import checkpoint, hf_reference, random_prompts, rel_err

from .conftest import DEVICE, generate
from .counting_backend import NAME, backend_report

SPEC = "distributed.counting_backend:register"
POOL = dict(num_pages=32, max_model_len=256, device=DEVICE)


@pytest.fixture
def clean_registry():
    """Backends registered during the test are forgotten after it."""
    before = set(registry._REGISTRY)
    yield
    for name in set(registry._REGISTRY) - before:
        del registry._REGISTRY[name]
        registry._CLASSES.pop(name, None)
        registry._INSTANCES.pop(name, None)


def test_a_backend_registered_in_rank_0_runs_on_every_rank(clean_registry, ckpt_root):
    path = checkpoint("llama", ckpt_root)
    prompts = random_prompts([1, 6, 19], seed=3, vocab=248)
    want = generate(LLM(path, attention_backend="torch", **POOL), prompts, 6, prompt_logits=False)
    assert cli.register([SPEC]) == {NAME: SPEC}
    with LLM(path, attention_backend=NAME, tensor_parallel_size=2, **POOL) as llm:
        got = generate(llm, prompts, 6, prompt_logits=False)
        report = llm.engine.call(backend_report)
    (name0, calls0), (name1, calls1) = report
    assert name0 == name1 == NAME
    assert calls0 == calls1 > 0  # the same forwards on both ranks, every one through the backend
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert rel_err(g.logits, w.logits) < 1e-4


def test_a_backend_defined_in_main_is_refused_before_any_rank_starts(clean_registry, ckpt_root):
    registry.register_backend("in_main", "__main__:Backend")
    with pytest.raises(ValueError, match=r"expected 'in_main' registered from an importable module .*__main__:Backend"):
        LLM(checkpoint("llama", ckpt_root), tensor_parallel_size=2, **POOL)


def test_generate_takes_register(clean_registry, ckpt_root, capsys):
    path = checkpoint("llama", ckpt_root)
    argv = ["generate", "--register", SPEC, "--attention-backend", NAME, "--model", path, "--prompt-ids", "4,8,15"]
    argv += ["--temperature", "0"]
    argv += ["--max-tokens", "5", "--ignore-eos", "--num-pages", "32", "--max-model-len", "256"]
    assert cli.main(argv) == 0
    assert f"output ids: {hf_reference(path, (4, 8, 15), 5)[0]}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_x", "--register no_such_module_x: cannot import no_such_module_x"),
        ("distributed.counting_backend:nope", "a function nope in distributed.counting_backend, got None"),
        ("distributed.counting_backend:", "expected --register MODULE[:FUNC] or NAME=MODULE:CLASS, got"),
        ("x=distributed.counting_backend:CountingBackend", "CountingBackend.name == 'x', got 'counting'"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_register_flags_are_one_line(command, spec, message, clean_registry, capsys):
    assert cli.main([command, "--register", spec, "--model", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"portattn {command}: error: ") and message in err
