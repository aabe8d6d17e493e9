"""The sampler's draw in one Triton pass (``kernels/triton/gumbel_max.py``) against its torch code,
the reference: the same tokens for the same logits, keys and steps (on the CPU through Triton's
interpreter; on a GPU natively, where ``sampler.draw`` takes it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.engine import sampler

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton.fused_launch import gumbel_max


def rows_of(n: int, seed: int, *, filters: bool) -> SimpleNamespace:
    """``n`` rows: every third greedy (temperature 1 there), the others at temperatures 0.3-1.5."""
    g = torch.Generator().manual_seed(seed)
    greedy = torch.arange(n) % 3 == 0
    temperature = torch.where(greedy, 1.0, 0.3 + 1.2 * torch.rand(n, generator=g))
    rows = SimpleNamespace(
        greedy=greedy,
        temperature=temperature,
        keys=torch.randint(0, 2**62, (n,), generator=g),
        steps=torch.randint(0, 5000, (n,), generator=g),
        min_p=None,
        top_k=None,
        top_p=None,
    )
    if filters:
        rows.min_p = torch.where(greedy, 0.0, 0.02)
        rows.top_k = torch.where(greedy, 1 << 62, torch.randint(1, 60, (n,), generator=g))
        rows.top_p = torch.where(greedy, 1.0, 0.5 + 0.5 * torch.rand(n, generator=g))
    return SimpleNamespace(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(rows).items()})


def reference_draw(logits: torch.Tensor, rows) -> torch.Tensor:
    """The plain draw in torch: Gumbel-max over the filtered logits (``sampler.draw`` for rows with
    ``top_k`` or without ``top_p``)."""
    tokens = torch.argmax(logits, dim=-1)
    scores = sampler.filter_logits(logits, rows)
    u = sampler.uniform_noise(rows.keys, rows.steps, logits.shape[-1])
    return torch.where(rows.greedy, tokens, torch.argmax(scores - torch.log(-torch.log(u)), dim=-1))


@pytest.mark.parametrize("vocab,chunk,block", [(1000, 256, 64), (77, 64, 32), (4096, 4096, 1024)])
@pytest.mark.parametrize("filters", [False, True])
def test_gumbel_max_draws_the_samplers_tokens(vocab, chunk, block, filters):
    n = 24
    logits = (3 * torch.randn(n, vocab, generator=torch.Generator().manual_seed(vocab))).to(DEVICE)
    rows = rows_of(n, vocab, filters=filters)
    words = sampler.row_words(rows.keys, rows.steps)
    if filters:
        scores = sampler.filter_logits(logits, rows)
        drawn = gumbel_max(scores, rows.temperature, words, rows.greedy, divide=False, chunk=chunk, block=block)
        got = torch.where(rows.greedy, torch.argmax(logits, dim=-1), drawn)
    else:
        got = gumbel_max(logits, rows.temperature, words, rows.greedy, divide=True, chunk=chunk, block=block)
    want = reference_draw(logits, rows)
    assert torch.equal(got, want)
    assert not torch.equal(got, torch.argmax(logits, dim=-1))  # the sampled rows did draw


def test_gumbel_max_takes_the_first_of_tied_best_tokens():
    """Greedy rows whose maximum repeats, within a chunk and across chunks: the first index wins, as
    ``torch.argmax``'s."""
    logits = torch.zeros(2, 300)
    logits[0, [40, 41, 250]] = 5.0
    logits[1, [260, 290]] = 7.0
    logits = logits.to(DEVICE)
    greedy = torch.ones(2, dtype=torch.bool, device=DEVICE)
    words = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    got = gumbel_max(logits, torch.ones(2, device=DEVICE), words, greedy, divide=True, chunk=128, block=32)
    assert got.tolist() == [40, 260]


def test_gumbel_max_draws_from_the_distribution():
    """Many draws of one row (keys differ) follow softmax(logits / T): chi-square over 6 tokens."""
    n = 6000 if DEVICE.type != "cpu" else 800  # the interpreter runs one program at a time
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = (probs.log() * 0.7).repeat(n, 1).to(DEVICE)  # temperature 0.7 undoes the 0.7
    keys = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    words = sampler.row_words(keys, torch.zeros(n, dtype=torch.int64, device=DEVICE))
    temperature = torch.full((n,), 0.7, device=DEVICE)
    greedy = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    tokens = gumbel_max(logits, temperature, words, greedy, divide=True).cpu()
    counts = torch.bincount(tokens, minlength=6).double()
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p < 0.001


@pytest.mark.skipif(DEVICE.type == "cpu", reason="sampler.draw takes the kernel on GPUs only")
@pytest.mark.parametrize("filters", [False, True])
def test_draw_takes_the_kernel_on_gpus(filters, monkeypatch):
    from portattn.kernels.triton import fused_launch

    calls = []
    for name in ("gumbel_max", "nucleus"):
        real = getattr(fused_launch, name)
        monkeypatch.setattr(fused_launch, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    logits = 3 * torch.randn(16, 32000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = rows_of(16, 2, filters=filters)  # with filters every sampled row has top_k: the nucleus draw alone
    assert torch.equal(sampler.draw(logits, rows), reference_draw(logits, rows))
    assert calls == (["nucleus"] if filters else ["gumbel_max"])
