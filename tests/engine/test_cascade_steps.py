"""Cascade attention chosen by the engine's plan (``engine/cascade_rule.py``): which steps take it, and
that those steps give the tokens and logits of plain paged attention, for every family a cascade
serves (full attention; layers with windows, chunks or sinks beside it), at awkward page sizes, with
NaN in every cache slot no sequence wrote, on the torch backend and on Triton under its interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from portattn.backends.registry import backend_class
from portattn.cascade import plan_cascade
from portattn.device import is_triton_interpreter
from portattn.engine.cascade_rule import CascadeRule, shared_prefix_pages
from portattn.engine.graphs import CASCADE
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.sequence import Sequence
from portattn.testing import no_host_sync
from tiny_models import checkpoint, random_prompts

TOL = 1e-5
PREFIX = random_prompts([40], seed=3)[0]
TAILS = random_prompts([1, 3, 5, 8, 2, 6], seed=4)  # the shared 40 tokens, then 1 to 8 of each request's own


def eager_llm(path: str, page_size: int, **kwargs) -> LLM:
    """Plain attention unless ``enable_cascade_attn=True``, then every eager step of two or more
    sequences that share a page takes the cascade (by default an eager step never does)."""
    kwargs.setdefault("enable_cascade_attn", False)
    llm = LLM(
        path,
        enforce_eager=True,
        page_size=page_size,
        num_pages=-(-2000 // page_size),
        max_model_len=256,
        max_num_seqs=8,
        **kwargs,
    )
    rule = llm.engine.runner.cascade_rule
    if rule is not None:
        llm.engine.runner.cascade_rule = dataclasses.replace(
            rule, min_batch=2, min_shared_tokens=1, eager_min_saved_bytes=0
        )
    return llm


def poison_free_slots(llm: LLM) -> None:
    """NaN in every cache slot: a slot that no sequence wrote must never reach an output."""
    pool = llm.engine.kv_pool
    for t in (*pool.k, *pool.v):
        t.fill_(float("nan"))


def shared_prefix_run(llm: LLM, max_tokens: int = 12) -> list:
    """The prefix alone first (prefix caching then hands its full pages to every request), then the
    six requests that extend it, decoding together."""
    llm.generate([PREFIX], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    return llm.generate([PREFIX + tail for tail in TAILS], params, use_tqdm=False)


def assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        err = float((g.logits - w.logits).abs().max() / w.logits.abs().max())
        assert err < TOL, err


@pytest.mark.parametrize(
    "family,page_size",
    [("llama", 1), ("llama", 3), ("llama", 7), ("llama", 16), ("gemma2", 7), ("gpt_oss", 16), ("llama4", 3)],
)
def test_cascade_steps_equal_plain(family, page_size, ckpt_root):
    """Gemma 2 alternates windowed layers (plain) with full ones (cascade), gpt-oss has sinks (in the
    own pass only) and windows, Llama 4 chunked layers (plain) beside global ones."""
    path = checkpoint(family, ckpt_root)
    plain = eager_llm(path, page_size)
    assert plain.engine.runner.cascade_rule is None
    want = shared_prefix_run(plain)
    llm = eager_llm(path, page_size, enable_cascade_attn=True)
    poison_free_slots(llm)
    assert_same(shared_prefix_run(llm), want)
    # The first token comes from the prompt step (an extend: plain); the 11 decode steps of the six
    # requests share the prefix's 40 // page_size pages.
    assert llm.engine.runner.cascade_steps == 11


@pytest.mark.skipif(not is_triton_interpreter(), reason="the CPU engine runs Triton only under its interpreter")
def test_cascade_steps_equal_plain_on_triton_interpreter(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    want = shared_prefix_run(eager_llm(path, 16, attention_backend="triton"), 4)
    llm = eager_llm(path, 16, attention_backend="triton", enable_cascade_attn=True)
    poison_free_slots(llm)
    assert_same(shared_prefix_run(llm, 4), want)
    assert llm.engine.runner.cascade_steps == 3


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_no_cascade_where_it_cannot_serve(family, ckpt_root):
    """MLA attends its latent rows; the tiny Mixtral's layers all have a sliding window."""
    llm = LLM(
        checkpoint(family, ckpt_root), enforce_eager=True, num_pages=100, max_model_len=256, enable_cascade_attn=True
    )
    assert llm.engine.runner.cascade_rule is None


def test_the_rule_counts_the_bytes_of_the_layers_it_serves(ckpt_root):
    """Gemma 2's windowed layers do not count in the bytes a cascade saves; Llama's all do."""
    rules = {}
    for family in ("llama", "gemma2"):
        llm = LLM(
            checkpoint(family, ckpt_root),
            enforce_eager=True,
            num_pages=100,
            max_model_len=256,
            enable_cascade_attn=True,
        )
        specs = llm.engine.model.attention_specs()
        served = [s for s in specs if s.window_left < 0]
        per_token = sum(s.num_kv_heads * (s.head_dim + s.v_head_dim) * 4 for s in served)  # float32 cache
        rules[family] = llm.engine.runner.cascade_rule
        assert rules[family].bytes_per_token == per_token
        assert len(served) == (len(specs) if family == "llama" else len(specs) // 2)


# -- the rule on sequences made by hand ---------------------------------------------------------------


def seq(pages: list[int], computed: int) -> Sequence:
    s = Sequence(0, list(range(computed + 1)), SamplingParams(temperature=0))
    s.pages, s.num_computed = list(pages), computed
    return s


def test_shared_prefix_pages():
    P = 4
    a = seq([5, 6, 7, 8, 9], 18)  # pages 0-3 full, its new token in page 4
    b = seq([5, 6, 7, 3, 2], 18)
    c = seq([5, 6, 1], 9)
    assert shared_prefix_pages([(a, 1), (a, 1)], P) == 4  # capped at the pages before the new tokens
    assert shared_prefix_pages([(a, 1), (b, 1)], P) == 3
    assert shared_prefix_pages([(a, 1), (b, 1), (c, 1)], P) == 2  # c has 9 tokens computed: 2 whole pages
    assert shared_prefix_pages([(a, 1), (b, 1), (c, 1)], P, at_least=3) == 0
    assert shared_prefix_pages([(a, 1), (seq([4, 6, 7], 12), 1)], P) == 0  # the first page differs
    assert shared_prefix_pages([(a, 1), (seq([5, 6], 3), 1)], P) == 0  # a new token inside the first page
    # A sequence whose new tokens start inside a shared page keeps that page out of the prefix.
    assert shared_prefix_pages([(a, 1), (seq([5, 6, 7, 8], 14), 2)], P) == 3


def rule(**kwargs) -> CascadeRule:
    return CascadeRule(**{"bytes_per_token": 1024, "min_shared_tokens": 64, "graph_min_saved_bytes": 0, **kwargs})


def batch(n: int, shared_pages: int, own_tokens: int, q: int = 1, page_size: int = 16) -> list:
    """``n`` sequences over ``shared_pages`` common pages and ``own_tokens`` of their own each."""
    out = []
    for i in range(n):
        own = [1000 * (i + 1) + j for j in range(-(-(own_tokens + q) // page_size))]
        out.append((seq(list(range(shared_pages)) + own, shared_pages * page_size + own_tokens), q))
    return out


def test_the_rule_takes_decodes_of_many_sequences_over_a_long_shared_prefix():
    assert rule().shared_tokens(batch(8, 8, 100), 16, replays=True) == 128
    assert rule().shared_tokens(batch(7, 8, 100), 16, replays=True) == 0  # fewer than min_batch
    assert rule().shared_tokens(batch(8, 3, 100), 16, replays=True) == 0  # 48 shared keys < 64
    assert rule().shared_tokens(batch(8, 8, 100, q=2), 16, replays=True) == 0  # more than max_q_len new tokens
    assert rule(max_q_len=2).shared_tokens(batch(8, 8, 100, q=2), 16, replays=True) == 128  # verification
    # The shared keys must be at least half of what the batch reads: 128 shared, 200 own each.
    assert rule().shared_tokens(batch(8, 8, 200), 16, replays=True) == 0
    assert rule(min_shared_fraction=0.3).shared_tokens(batch(8, 8, 200), 16, replays=True) == 128
    # A cascade needs (B - 1) * shared * bytes_per_token >= the bound of the step's kind: by default
    # none for an eager step (it never cascades).
    saved = 7 * 128 * 1024
    assert rule(graph_min_saved_bytes=saved).shared_tokens(batch(8, 8, 100), 16, replays=True) == 128
    assert rule(graph_min_saved_bytes=saved + 1).shared_tokens(batch(8, 8, 100), 16, replays=True) == 0
    assert rule(graph_min_saved_bytes=0).shared_tokens(batch(8, 8, 100), 16, replays=False) == 0
    assert rule(eager_min_saved_bytes=saved).shared_tokens(batch(8, 8, 100), 16, replays=False) == 128
    assert rule(eager_min_saved_bytes=saved + 1).shared_tokens(batch(8, 8, 100), 16, replays=False) == 0


def test_the_default_graph_bound():
    """By default (4 GiB) a graph step of an 8B-shaped model (128 KiB of K/V per token) cascades in its
    cascade shape with 64 sequences over 1,024 shared tokens (8.5 GB not read again), not with 8 (0.9
    GB); an eager step never does; ``None`` keeps every graph step plain."""
    default = CascadeRule(bytes_per_token=32 * 8 * 256 * 2)
    assert default.shared_tokens(batch(64, 64, 256), 16, replays=True) == 1024
    assert default.shared_tokens(batch(8, 64, 256), 16, replays=True) == 0
    assert default.shared_tokens(batch(64, 512, 256), 16, replays=False) == 0
    never = dataclasses.replace(default, graph_min_saved_bytes=None)
    assert never.shared_tokens(batch(64, 512, 256), 16, replays=True) == 0


def static_llm(path: str, page_size: int, **kwargs) -> LLM:
    """The engine on the static-buffer path of captured decode (run eagerly: capture=False), buckets
    1, 2, 4, 8 (the six requests run padded to 8), cascading every decode step that shares a page."""
    llm = eager_llm(path, page_size, enable_cascade_attn=True, **kwargs)
    runner = llm.engine.runner
    runner.enable_graphs((1, 2, 4, 8), capture=False).capture_all()
    runner.cascade_rule = dataclasses.replace(runner.cascade_rule, graph_min_saved_bytes=0)
    return llm


@pytest.mark.parametrize(
    "family,page_size", [("llama", 1), ("llama", 7), ("llama", 16), ("gemma2", 7), ("gpt_oss", 16), ("llama4", 3)]
)
def test_cascade_shapes_of_the_graphs_equal_plain(family, page_size, ckpt_root):
    """The graphs' cascade shape (the shared length a static input, the own and shared passes planned
    inside the step) gives plain attention's tokens and logits: padding rows in the scratch page, NaN in
    every unwritten slot (the scratch page too), layers with windows, chunks and sinks beside."""
    path = checkpoint(family, ckpt_root)
    want = shared_prefix_run(eager_llm(path, page_size))
    llm = static_llm(path, page_size)
    poison_free_slots(llm)
    assert_same(shared_prefix_run(llm), want)
    runner = llm.engine.runner
    assert runner.cascade_steps == 11 and runner.graphs.replays == 11
    assert runner.graphs.padded == {6: 11}
    assert (8, 1, CASCADE) in runner.graphs.contexts


@pytest.mark.skipif(not is_triton_interpreter(), reason="the CPU engine runs Triton only under its interpreter")
def test_cascade_shapes_on_triton_interpreter(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    want = shared_prefix_run(eager_llm(path, 16, attention_backend="triton"), 4)
    llm = static_llm(path, 16, attention_backend="triton")
    poison_free_slots(llm)
    assert_same(shared_prefix_run(llm, 4), want)
    assert llm.engine.runner.cascade_steps == 3


def test_a_step_below_the_graph_bound_replays_the_plain_shape(ckpt_root):
    """The rule's graph bound decides between a graph's cascade shape and its plain one; a sampled
    step cascades inside the graph too (the draw after it)."""
    path = checkpoint("llama", ckpt_root)
    llm = static_llm(path, 16)
    runner = llm.engine.runner
    runner.cascade_rule = dataclasses.replace(runner.cascade_rule, graph_min_saved_bytes=None)
    want = shared_prefix_run(eager_llm(path, 16))
    assert_same(shared_prefix_run(llm), want)
    assert runner.cascade_steps == 0 and runner.graphs.replays == 11
    assert not [shape for shape in runner.graphs.contexts if len(shape) == 3]
    runner.cascade_rule = dataclasses.replace(runner.cascade_rule, graph_min_saved_bytes=0)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True)
    prompts = [PREFIX + tail for tail in TAILS]
    plain = eager_llm(path, 16).generate(prompts, sampled, use_tqdm=False)
    got = llm.generate(prompts, sampled, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert runner.cascade_steps == 5 and runner.graphs.sampled == 5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_cascade_plan_reads_no_length_back_from_the_device(backend):
    """Given the engine's host lengths, planning both passes of a cascade syncs nothing."""
    impl = backend_class(backend)()
    P, shared = 16, 64
    k_lens, q_lens = [70, 75, 90], [1, 1, 1]
    page_table = torch.tensor([[0, 1, 2, 3, 4 + b, 0] for b in range(3)], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    seq_lens = torch.tensor(k_lens, dtype=torch.int32)
    with no_host_sync():
        md = plan_cascade(impl, page_table, cu, seq_lens, P, shared, num_heads=4, host_lens=(q_lens, k_lens))
    assert md.own.k_lens == (6, 11, 26) and md.shared.k_lens == (shared,) and md.shared.q_lens == (3,)


def test_verification_steps_cascade_with_a_causal_own_pass(ckpt_root):
    """Speculative decoding's verification steps (k + 1 new tokens a sequence) cascade eagerly: the
    own pass is causal over each sequence's new tokens. The draft is the model itself (every proposal
    verified in steps of 4 tokens); the tokens equal plain decoding's."""
    path = checkpoint("llama", ckpt_root)
    spec = {"model": path, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    prefix = PREFIX
    prompts = [prefix + tail for tail in TAILS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in eager_llm(path, 8).generate(prompts, params, use_tqdm=False)]
    llm = eager_llm(path, 8, enable_cascade_attn=True, speculative_config=spec)
    assert llm.engine.runner.cascade_rule.max_q_len == 4
    llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    runner, cascaded = llm.engine.runner, []
    plan = runner.plan

    def spy(scheduled, shared_prefix_len=0, feed=None):
        if shared_prefix_len:
            cascaded.append(max(n for _, n in scheduled))
        return plan(scheduled, shared_prefix_len, feed)

    runner.plan = spy
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert 4 in cascaded  # verification steps of 3 proposed tokens went through the cascade
