"""Asynchronous scheduling (``engine/run_ahead.py``) on the static decode path, run eagerly on the CPU:
steps launched before the previous step's tokens are read give the tokens of synchronous scheduling
(greedy, seeded sampling, stop tokens and strings found one step late, ``max_tokens`` and
``max_model_len`` stops left out of the step ahead), with admissions, preemption, prefix caching and
aborts in between, and the pools consistent after every step."""

from __future__ import annotations

import pytest

from portattn.engine.config import EngineConfig
from portattn.engine.graphs import batch_size_buckets
from portattn.engine.llm import LLM
from portattn.engine.run_ahead import RunAhead
from portattn.engine.sampling_params import SamplingParams
from portattn.testing.chat import save_tiny_chat_checkpoint
from tiny_models import checkpoint, random_prompts

from .test_interrupted_bookkeeping import assert_pools_consistent

PROMPTS = random_prompts([1, 5, 15, 17, 30, 37], seed=21)


def static(path: str, ahead: bool, **kwargs) -> LLM:
    """The engine with captured-step buffers run eagerly, and with ``ahead`` asynchronous scheduling."""
    kwargs = dict(page_size=4, num_pages=300, max_model_len=96, max_num_seqs=4) | kwargs
    llm = LLM(path, enforce_eager=True, **kwargs)
    engine = llm.engine
    engine.runner.enable_graphs(batch_size_buckets(engine.config.max_num_seqs), capture=False, feed=ahead)
    engine.runner.graphs.capture_all()
    if ahead:
        engine.run_ahead = RunAhead(engine)
    return llm


def run(llm: LLM, prompts, params) -> list[list[int]]:
    """Step the engine by hand (pools checked after each step); the output tokens of each request."""
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(2000):  # far more steps than these requests need: a step that computes nothing fails
        if not engine.has_unfinished():
            break
        engine.step()
        assert_pools_consistent(engine)
    assert not engine.has_unfinished()
    return [seq.output_token_ids for seq in seqs]


def test_tokens_equal_synchronous_scheduling(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 9, 14, 30, 21)]
    sampled = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True) for s in range(6)
    ]
    for params in (greedy, sampled):
        want = run(static(path, ahead=False), PROMPTS, params)
        llm = static(path, ahead=True)
        assert run(llm, PROMPTS, params) == want
        assert llm.engine.run_ahead.steps_ahead > 5  # decodes overlapped once no request waits
        assert llm.engine.run_ahead.eager_ahead > 0  # prefills launched before the caller had the tokens


def test_eager_steps_launched_ahead_in_chunks_with_logprobs(ckpt_root):
    """Prompts cut into chunks of a small token budget beside decodes: each eager step launched right
    after the previous step's tokens are read, its own read by the next call, gives the tokens and
    log-probabilities of synchronous scheduling. A request that scores its prompt (prompt
    log-probabilities) or keeps its logits reads the device as its steps run: no step holding it while
    it does is launched ahead, and its answers are synchronous scheduling's too."""
    path = checkpoint("llama", ckpt_root)
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3) for _ in PROMPTS]
    params[2] = SamplingParams(temperature=0.7, seed=5, max_tokens=7, ignore_eos=True, logprobs=2)
    params[4] = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    params[5] = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, return_logits=True)
    kwargs = dict(max_num_batched_tokens=8)
    plain = static(path, ahead=False, **kwargs)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    llm = static(path, ahead=True, **kwargs)
    runner, launched = llm.engine.runner, []
    launch = runner.launch

    def recorded(scheduled, want_rows, cascade=None, feed=None):
        launched.append(want_rows)
        return launch(scheduled, want_rows, cascade, feed)

    runner.launch = recorded
    engine, reads, calls = llm.engine, [0], []  # steps whose tokens each engine.step call reads

    def counted(fn):
        def wrapper(*args, **kwargs):
            reads[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    def counted_step(step=engine.step):
        reads[0] = 0
        finished = step()
        calls.append(reads[0])
        return finished

    engine.run_step, engine.run_ahead._take_eager = counted(engine.run_step), counted(engine.run_ahead._take_eager)
    runner.graphs.collect, engine.step = counted(runner.graphs.collect), counted_step
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert max(calls) == 1  # a synchronous step is left to the next call, not run behind a step read
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.prompt_logprobs == b.prompt_logprobs
        assert (a.outputs[0].logits is None) == (b.outputs[0].logits is None)
    assert got[4].prompt_logprobs is not None and got[5].outputs[0].logits is not None
    assert len(launched) > 10 and sum(len(rows.sampling) > 1 for rows in launched) > 3
    for rows in launched:  # no step launched ahead scores a prompt or samples the request keeping its logits
        assert not rows.prompt_rows and all(seq.params.return_logits is False for seq in rows.sampling)
    assert any(seq.params.logprobs for rows in launched for seq in rows.sampling)
    assert_pools_consistent(llm.engine)


def test_a_full_batch_runs_ahead_while_requests_wait(ckpt_root):
    """With ``max_num_seqs`` sequences running the scheduler admits nobody, so the steps of the first
    wave run ahead although requests wait; once a place frees up, the waiting request is admitted at
    the step synchronous scheduling admits it (the sequence that stops at its length is left out of the
    step ahead, so the step after it is scheduled as usual)."""
    path = checkpoint("llama", ckpt_root)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 16, 9, 14, 10, 11)]
    want = run(static(path, ahead=False, max_num_seqs=2), PROMPTS, params)
    llm = static(path, ahead=True, max_num_seqs=2)
    engine = llm.engine
    waiting = []  # whether requests waited at each launch ahead
    launch = engine.run_ahead._launch

    def counted(scheduled, feed, feed_ids=None):
        if feed is not None:
            waiting.append(bool(engine.scheduler.waiting))
        return launch(scheduled, feed, feed_ids)

    engine.run_ahead._launch = counted
    assert run(llm, PROMPTS, params) == want
    assert sum(waiting) > 10 and not all(waiting)


def test_stops_found_one_step_late_drop_the_step_ahead(ckpt_root):
    path = checkpoint("qwen3", ckpt_root)
    plain = static(path, ahead=False)
    free = run(plain, PROMPTS[:4], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 4)
    # Stop tokens met mid-answer: each request stops at the 6th, 2nd, 11th and 1st token of its free answer.
    stops = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[out[i]]) for out, i in zip(free, (5, 1, 10, 0))
    ]
    want = run(plain, PROMPTS[:4], stops)
    llm = static(path, ahead=True)
    assert run(llm, PROMPTS[:4], stops) == want
    assert [len(out) for out in want] == [free[0].index(free[0][5]) + 1, free[1].index(free[1][1]) + 1,
                                          free[2].index(free[2][10]) + 1, 1]  # fmt: skip
    assert llm.engine.run_ahead.steps_ahead > 0
    llm.engine.pages.clear_cache()
    assert llm.engine.allocator.num_used == 0 and not llm.engine.scheduler.running


def test_stop_strings_and_max_model_len(tmp_path):
    path = save_tiny_chat_checkpoint(tmp_path / "chat")
    plain = static(path, ahead=False, max_model_len=40)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 9]
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # found in the first answer only
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]) for _ in prompts]
    want = plain.generate(prompts, params, use_tqdm=False)
    llm = static(path, ahead=True, max_model_len=40)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == ["stop", "length", "length"]  # max_model_len 40
    assert llm.engine.run_ahead.steps_ahead > 0


def test_admissions_preemption_prefix_caching_and_aborts(ckpt_root):
    path = checkpoint("llama4", ckpt_root)
    shared = PROMPTS[4][:16]
    prompts = [shared + p for p in PROMPTS] + PROMPTS  # twelve requests, a shared prefix for six
    params = [SamplingParams(temperature=0, max_tokens=8 + i % 5, ignore_eos=True) for i in range(len(prompts))]
    # 24 pages of 4 tokens cannot hold four growing sequences of up to 65 tokens: preemption.
    kwargs = dict(num_pages=24, enable_prefix_caching=True)
    want = run(static(path, ahead=False, **kwargs), prompts, params)
    llm = static(path, ahead=True, **kwargs)
    assert run(llm, prompts, params) == want
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.pages.num_cached_tokens > 0
    assert engine.run_ahead.steps_ahead > 0

    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in PROMPTS[:3]]
    aborted = False
    while engine.has_unfinished():
        engine.step()
        if not aborted and engine.run_ahead.launched is not None and seqs[1] in engine.run_ahead.launched.seqs:
            engine.abort(seqs[1].request_id)  # its step is in flight
            aborted = True
        assert_pools_consistent(engine)
    assert aborted and seqs[1].finish_reason == "abort"
    alone = run(static(path, ahead=False, **kwargs), [PROMPTS[0], PROMPTS[2]], [seqs[0].params] * 2)
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == alone


def test_settled_steps_go_on_synchronously(ckpt_root):
    """``RunAhead.settle`` reads the step in flight and launches none: the engine then steps
    synchronously from tokens the host knows, and the tokens equal synchronous scheduling's; the
    sequences that stop with the settled tokens are returned."""
    path = checkpoint("llama", ckpt_root)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 12, 9, 14)]
    want = run(static(path, ahead=False), PROMPTS[:4], params)
    llm = static(path, ahead=True)
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:4], params)]
    while engine.run_ahead.launched is None or len(seqs[0].output_token_ids) < 6:
        engine.step()  # until the step that samples the first request's last token is in flight
    ahead = engine.run_ahead
    in_flight = [len(seq.output_token_ids) for seq in seqs]
    finished = ahead.settle()
    assert finished == [seqs[0]] and seqs[0].finish_reason == "length"
    assert [len(seq.output_token_ids) for seq in seqs] == [n + 1 for n in in_flight]
    assert ahead.launched is None and ahead.settle() == []
    assert_pools_consistent(engine)
    engine.run_ahead = None
    while engine.has_unfinished():
        engine.step()
        assert_pools_consistent(engine)
    assert [seq.output_token_ids for seq in seqs] == want


def test_async_scheduling_is_refused_where_it_cannot_run(ckpt_root, caplog):
    path = checkpoint("llama", ckpt_root)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"async_scheduling .* without speculative decoding, got speculative_config"):
        EngineConfig(model=path, async_scheduling=True, speculative_config=spec)
    with pytest.raises(ValueError, match="got tensor_parallel_size 2"):
        EngineConfig(model=path, async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match=r"async_scheduling \(--async-scheduling\) to be None \(auto\) or a bool, got 1"
    ):
        EngineConfig(model=path, async_scheduling=1)
    # By default (None) it runs where it can: with speculative decoding or several processes it is off.
    assert EngineConfig(model=path).async_scheduling is None
    assert EngineConfig(model=path, speculative_config=spec, tensor_parallel_size=2).async_scheduling is None
    small = dict(page_size=4, num_pages=100, max_model_len=64)
    with caplog.at_level("WARNING", logger="portattn"):
        assert LLM(path, **small).engine.run_ahead is None  # the CPU: no captured graphs, off by default
    assert "async_scheduling" not in caplog.text
    with caplog.at_level("WARNING", logger="portattn"):
        assert LLM(path, async_scheduling=True, **small).engine.run_ahead is None  # asked for: said so
    assert "async_scheduling=True but it is off: it needs captured decode steps (torch has no graphs" in caplog.text


def test_an_eager_step_launch_reads_nothing_back(ckpt_root):
    """``ModelRunner.launch`` of a mixed step (decodes beside a new prompt, seeded sampling with
    log-probabilities) plans, runs and samples without reading a device value (the host-sync guard);
    its tokens, read after, are those the synchronous step samples."""
    from portattn.testing import no_host_sync

    path = checkpoint("llama", ckpt_root)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True, logprobs=2) for s in range(3)
    ]
    results = {}
    for launched in (False, True):
        engine = static(path, ahead=False).engine
        seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
        engine.step()  # both prompts
        engine.step()  # a decode step
        seqs.append(engine.add_request(PROMPTS[3], params[2]))
        scheduled = engine.scheduler.schedule()
        assert sorted(n for _, n in scheduled) == [1, 1, len(PROMPTS[3])]
        runner = engine.runner
        want = runner.logit_rows(scheduled)
        if launched:
            assert runner.defers(want)
            with no_host_sync():
                started = runner.launch(scheduled, want)
            sampled = runner.sampled(started)
        else:
            sampled = runner.step(scheduled, want)
        results[launched] = [sampled[seq] for seq in seqs]
    assert results[True] == results[False]


def test_prompt_chunks_launched_before_the_tokens_in_flight_are_read(ckpt_root):
    """Prompts arriving while others decode, cut into chunks of a small token budget: the step after a
    launched one is scheduled and launched before that step's tokens are read (the tokens in flight
    copied on the device into its inputs): eager steps fed from a decode graph's ids and from an eager
    step's, and decode graphs fed from an eager step's. Greedy and seeded sampling, ``min_tokens``
    (its ban lifted one token ahead), stop tokens found one step late and ``max_tokens``: the tokens
    of synchronous scheduling, the pools consistent after every step."""
    path = checkpoint("llama", ckpt_root)
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=7, min_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=6, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    kwargs = dict(max_num_batched_tokens=8)
    free = run(static(path, ahead=False, **kwargs), PROMPTS, params)
    params[3] = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[3][4]])  # stops at its 5th token
    params[2] = SamplingParams(temperature=0.9, seed=4, max_tokens=7, min_tokens=4, stop_token_ids=[free[2][1]])

    def arriving(llm: LLM) -> list[list[int]]:
        engine, seqs = llm.engine, []
        for step in range(2000):
            if step % 3 == 0 and len(seqs) < len(PROMPTS):  # a request arrives every third step
                seqs.append(engine.add_request(PROMPTS[len(seqs)], params[len(seqs)]))
            if len(seqs) == len(PROMPTS) and not engine.has_unfinished():
                break
            engine.step()
            assert_pools_consistent(engine)
        return [seq.output_token_ids for seq in seqs]

    want = arriving(static(path, ahead=False, **kwargs))
    assert want[3] == free[3][: free[3].index(free[3][4]) + 1] and len(want[2]) >= 4
    llm = static(path, ahead=True, **kwargs)
    runner, fed_from = llm.engine.runner, []
    launch, graph_launch = runner.launch, runner.graphs.launch

    def recorded(scheduled, want_rows, cascade=None, feed=None):
        if feed is not None:
            fed_from.append("graph" if feed.ids is runner.graphs.tokens else "eager")
        return launch(scheduled, want_rows, cascade, feed)

    def recorded_graph(seqs, feed=None, cascade=0, feed_ids=None):
        if feed_ids is not None:
            fed_from.append("eager into a graph")
        return graph_launch(seqs, feed, cascade, feed_ids)

    runner.launch, runner.graphs.launch = recorded, recorded_graph
    assert arriving(llm) == want
    assert {"graph", "eager", "eager into a graph"} <= set(fed_from)
    assert llm.engine.run_ahead.eager_fed == fed_from.count("graph") + fed_from.count("eager") > 5


def test_a_fed_step_launch_reads_nothing_back(ckpt_root):
    """A mixed step launched while the previous step's tokens are on their way (``ModelRunner.launch``
    with a ``Feed`` of that step's ids on the device) plans, runs and samples without reading a device
    value; its tokens equal those of the same step run once the tokens are read."""
    from portattn.engine.model_runner import Feed
    from portattn.testing import no_host_sync

    path = checkpoint("llama", ckpt_root)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True) for s in range(3)]
    results = {}
    for fed in (False, True):
        engine = static(path, ahead=False).engine
        runner, scheduler = engine.runner, engine.scheduler
        seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
        engine.step()  # both prompts
        first = scheduler.schedule()  # a decode step, launched and not read
        started = runner.launch(first, runner.logit_rows(first))
        engine.mark_computed(first)
        seqs.append(engine.add_request(PROMPTS[3], params[2]))
        if fed:
            scheduled = scheduler.schedule_ahead(seqs[:2])
            feed = Feed(started.ids, {seq: row for row, seq in enumerate(started.sampling)})
            want = runner.logit_rows(scheduled, feed.rows)
            with no_host_sync():
                second = runner.launch(scheduled, want, 0, feed)
            tokens = runner.sampled(started)
            for seq in seqs[:2]:
                engine.append_tokens(seq, *tokens[seq])
            engine.mark_computed(scheduled)
        else:
            for seq, (t, lp) in runner.sampled(started).items():
                engine.append_tokens(seq, t, lp)
            scheduled = scheduler.schedule()
            second = runner.launch(scheduled, runner.logit_rows(scheduled))
        assert sorted(n for _, n in scheduled) == [1, 1, len(PROMPTS[3])]
        sampled = runner.sampled(second)
        results[fed] = [seq.output_token_ids for seq in seqs[:2]] + [sampled[seq] for seq in seqs]
    assert results[True] == results[False]


def test_capped_prompt_chunks_ahead_give_the_same_tokens(ckpt_root):
    """``long_prefill_token_threshold``: prompts in chunks of at most 5 tokens beside running decodes, each
    chunk launched ahead of the previous step's tokens, give the tokens of synchronous scheduling without a cap."""
    path = checkpoint("llama", ckpt_root)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 8, 11, 2, 9, 14)]
    want = run(static(path, ahead=False, max_num_batched_tokens=32), PROMPTS, params)
    llm = static(path, ahead=True, max_num_batched_tokens=32, long_prefill_token_threshold=5)
    assert run(llm, PROMPTS, params) == want
    assert llm.engine.run_ahead.eager_ahead > 5 and llm.engine.run_ahead.eager_fed > 0


def test_warm_up_runs_the_lm_head_at_every_sampled_row_count(ckpt_root, monkeypatch, caplog):
    """The warm-up (on a GPU: here the device check says so) runs the LM head at each count of rows from 1
    to ``max_num_seqs``, last, so that no step launched ahead is the first to load a kernel of its count;
    ``warm_logits`` names what it expects."""
    from portattn.engine import engine as engine_module
    from portattn.kernels.triton import compile_ahead

    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=300, max_model_len=96, max_num_seqs=5)
    engine = llm.engine
    counts = []
    engine.runner.model.lm_head.register_forward_hook(lambda module, args, out: counts.append(args[0].shape[0]))
    monkeypatch.setattr(engine_module, "is_gpu", lambda device: True)
    monkeypatch.setattr(compile_ahead, "log_late_compiles", lambda: None)
    with caplog.at_level("INFO", logger="portattn"):
        engine.warm_up()
    assert counts[-6:] == [1, 1, 2, 3, 4, 5]  # (the last warm-up prompt's decode, then the counts)
    assert "the LM head at 1 to 5 rows" in caplog.text
    with pytest.raises(ValueError, match="expected max_rows to be a positive int, got 0"):
        engine.runner.warm_logits(0)
