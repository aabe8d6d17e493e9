"""Top-p sampling without a sort (``kernels/triton/nucleus.py``) against its torch code
(``sampler.nucleus_draw``): the same tokens, rounds of rejection included; both against the exact
nucleus distribution (chi-square); round 0 is the plain draw; the fallback after the last round.
On the CPU through Triton's interpreter; on a GPU natively."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.engine import sampler

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton.fused_launch import gumbel_max, nucleus


def rows(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    greedy = torch.arange(n) % 5 == 0
    out = dict(
        temperature=torch.where(greedy, 1.0, 0.5 + torch.rand(n, generator=g)),
        top_p=torch.where(greedy, 1.0, torch.tensor([0.05, 0.3, 0.6, 0.9, 1.0]).repeat(n)[:n]),
        words=sampler.row_words(torch.randint(0, 2**62, (n,), generator=g), torch.randint(0, 99, (n,), generator=g)),
        greedy=greedy,
    )
    return {k: v.to(DEVICE) for k, v in out.items()}


def round0_in_nucleus(s: torch.Tensor, r: dict) -> torch.Tensor:
    """Whether each row's plain Gumbel-max draw (round 0) lies in its nucleus."""
    u = sampler.noise_of_words(r["words"], s.shape[-1])
    t = torch.argmax(s - torch.log(-torch.log(u)), dim=-1)
    p = torch.softmax(s, dim=-1)
    above = torch.where(s > s.gather(1, t[:, None]), p, 0.0).sum(-1)
    return above < r["top_p"]


@pytest.mark.parametrize("vocab,block", [(1000, 128), (77, 32), (3000, 1024)])
@pytest.mark.parametrize("divide", [True, False])
def test_the_kernel_draws_the_torch_codes_tokens(vocab, block, divide):
    n = 40
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(n, vocab, generator=g) * torch.linspace(0.3, 4, n)[:, None]).to(DEVICE)  # flat to peaked
    r = rows(n, vocab)
    scores = logits if divide else logits / r["temperature"][:, None]
    if not divide:  # scaled and masked as min_p leaves them
        scores = scores.masked_fill(torch.rand(n, vocab, generator=g).to(DEVICE) < 0.2, float("-inf"))
    args = (scores, r["temperature"], r["top_p"], r["words"], r["greedy"])
    want = sampler.nucleus_draw(*args, divide=divide)
    got = nucleus(*args, divide=divide, rounds=sampler.NUCLEUS_ROUNDS, block=block)
    assert torch.equal(got, want)
    s = scores / r["temperature"][:, None] if divide else scores
    assert not round0_in_nucleus(s, r).all()  # some rows needed more than one round
    assert torch.equal(got[r["greedy"]], torch.argmax(s, dim=-1)[r["greedy"]])


def test_round_0_is_the_plain_draw():
    """Rows with top_p 1, or whose first draw lands in the nucleus, take the plain Gumbel-max token."""
    n, vocab = 30, 500
    logits = (2 * torch.randn(n, vocab, generator=torch.Generator().manual_seed(3))).to(DEVICE)
    r = rows(n, 3)
    plain = gumbel_max(logits, r["temperature"], r["words"], r["greedy"], divide=True)
    got = nucleus(logits, r["temperature"], r["top_p"], r["words"], r["greedy"], divide=True, rounds=8)
    same = round0_in_nucleus(logits / r["temperature"][:, None], r) | r["greedy"]
    assert same.any() and torch.equal(got[same], plain[same])


def test_after_the_last_round_a_row_takes_its_top_token():
    logits = torch.zeros(4, 200)
    logits[:, 7] = 1.0  # a flat tail: with top_p 0.01 nearly every draw is rejected
    logits = logits.to(DEVICE)
    words = sampler.row_words(torch.arange(4, device=DEVICE) * 977, torch.zeros(4, dtype=torch.int64, device=DEVICE))
    args = (logits, torch.ones(4, device=DEVICE), torch.full((4,), 0.01, device=DEVICE), words)
    greedy = torch.zeros(4, dtype=torch.bool, device=DEVICE)
    assert nucleus(*args, greedy, divide=True, rounds=1).tolist() == [7] * 4
    assert sampler.nucleus_draw(*args, greedy, divide=True, rounds=1).tolist() == [7] * 4


def draw_counts(probs: torch.Tensor, top_p: float, use_kernel: bool, seed: int, top_k: int | None = None):
    """``(n, counts)``: how often each token of ``probs`` is drawn over ``n`` rows of its log (one key
    each), by the kernel (its tokens those of the torch code for the same keys) or the torch code."""
    # The interpreter runs a program a row: 300 rows on the CPU. The chi-square bounds keep their p < 0.001
    # at any n (the smallest expected count is 56 here), and the kernel's draws, equal to the torch code's
    # row by row, follow the distribution that the torch code's test checks over 1500 rows.
    n = 6000 if DEVICE.type != "cpu" else 300 if use_kernel else 1500
    logits = probs.log().repeat(n, 1).to(DEVICE)
    words = sampler.row_words(
        torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE),
        torch.zeros(n, dtype=torch.int64, device=DEVICE),
    )
    args = (logits, torch.ones(n, device=DEVICE), torch.full((n,), top_p, device=DEVICE), words)
    greedy = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    ks = None if top_k is None else torch.full((n,), top_k, dtype=torch.int64, device=DEVICE)
    tokens = sampler.nucleus_draw(*args, greedy, divide=True, rounds=sampler.NUCLEUS_ROUNDS, top_k=ks)
    if use_kernel:
        torch_tokens = tokens
        tokens = nucleus(*args, greedy, divide=True, rounds=sampler.NUCLEUS_ROUNDS, top_k=ks)
        assert torch.equal(tokens, torch_tokens)
    tokens = tokens.cpu()
    return n, torch.bincount(tokens, minlength=len(probs)).double()


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_draws_follow_the_nucleus_distribution(use_kernel):
    """top_p 0.7 over probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 keeps the first three (the mass
    above the fourth is 0.8): draws over many keys follow 0.4 : 0.25 : 0.15 (chi-square)."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n, counts = draw_counts(probs, 0.7, use_kernel, seed=1)
    assert counts[3:].sum() == 0
    expected = probs[:3].double() / 0.8 * n
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 2 degrees of freedom: p < 0.001


def top_k_rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    """k per row: 1, small, the vocabulary and past it (every token), and in between."""
    ks = torch.tensor([1, 2, 5, 17, vocab - 1, vocab, vocab + 3, 1 << 62])
    return ks.repeat(n)[:n].to(DEVICE)


# Vocabularies of several blocks, the last one partial (500 = 3 * 128 + 116, 77 = 2 * 32 + 13)
@pytest.mark.parametrize("vocab,block", [(500, 128), (77, 32)])
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("cap", [0, 8], ids=["search", "topk_then_search"])
def test_top_k_without_a_sort_draws_the_torch_codes_tokens(vocab, block, divide, cap):
    """Top-k by a search of the scores' keys (the kernel; with ``cap`` 8, rows of k <= 8 take their
    k-th largest from ``torch.topk`` first) and by a sort of them (the torch code) give the same set,
    so the same tokens; with ties at the k-th score (rounded logits), masked tokens and top_p beside it."""
    n = 40
    g = torch.Generator().manual_seed(vocab + 1)
    logits = (torch.randn(n, vocab, generator=g) * torch.linspace(0.3, 4, n)[:, None]).to(DEVICE)
    logits[::3] = (logits[::3] * 2).round() / 2  # ties everywhere, the k-th score's among them
    r = rows(n, vocab)
    scores = logits if divide else logits / r["temperature"][:, None]
    if not divide:
        scores = scores.masked_fill(torch.rand(n, vocab, generator=g).to(DEVICE) < 0.2, float("-inf"))
    top_k = top_k_rows(n, vocab, vocab)
    args = (scores, r["temperature"], r["top_p"], r["words"], r["greedy"])
    want = sampler.nucleus_draw(*args, divide=divide, top_k=top_k)
    got = nucleus(*args, divide=divide, rounds=sampler.NUCLEUS_ROUNDS, block=block, top_k=top_k, top_k_cap=cap)
    assert torch.equal(got, want)
    s = scores / r["temperature"][:, None] if divide else scores
    kth = s.sort(dim=-1, descending=True).values.gather(1, (top_k.clamp(max=vocab) - 1)[:, None])
    assert bool((s.gather(1, got[:, None]) >= kth).all())  # every token within its row's top k
    whole = sampler.nucleus_draw(*args, divide=divide)  # no top_k: some rows draw outside their top k
    assert not torch.equal(whole, want)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_draws_follow_the_top_k_then_top_p_distribution(use_kernel):
    """top_k 4 over probabilities 0.3, 0.2, 0.15, 0.15, 0.1, 0.1 keeps the first four (mass 0.8); top_p
    0.55 applies to that mass: tokens with less than 0.55 * 0.8 = 0.44 above them stay, the first two
    (the third and its tie have 0.5 above; over the whole distribution they would stay). Draws follow
    0.3 : 0.2 (chi-square)."""
    probs = torch.tensor([0.3, 0.2, 0.15, 0.15, 0.1, 0.1])
    n, counts = draw_counts(probs, 0.55, use_kernel, seed=2, top_k=4)
    assert counts[2:].sum() == 0
    expected = torch.tensor([0.6, 0.4], dtype=torch.float64) * n
    chi2 = float(((counts[:2] - expected) ** 2 / expected).sum())
    assert chi2 < 10.8  # 1 degree of freedom: p < 0.001
