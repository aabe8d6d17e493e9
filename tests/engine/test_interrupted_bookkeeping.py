"""An exception at any line of the page bookkeeping leaves the pools consistent and later runs exact.

A ``sys.settrace`` tracer counts the lines executed in the bookkeeping modules (allocator, page
manager, scheduler, request rows, engine, ``LLM.generate``) during one run, then raises
``KeyboardInterrupt`` or ``MemoryError`` at one hit of each of those lines in turn. After each
interrupted call the pools must be exactly what their holders say, and two later ``generate``
calls must give the uninterrupted tokens.
"""

from __future__ import annotations

import random
import sys
from collections import Counter

import pytest

from portattn import paging
from portattn.engine import engine as engine_module
from portattn.engine import llm as llm_module
from portattn.engine import page_manager, req_pool, run_ahead, scheduler
from portattn.engine.graphs import batch_size_buckets
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from tiny_models import checkpoint, random_prompts

# The bookkeeping: every function of the allocator, page manager and scheduler modules, and the
# functions of the request-row pool, the engine and LLM that add, step, abort or clean up.
FILES = {
    paging.__file__: None,
    page_manager.__file__: None,
    scheduler.__file__: None,
    req_pool.__file__: {"alloc", "free", "write_pages"},
    engine_module.__file__: {
        "add_request",
        "abort",
        "step",
        "run_step",
        "mark_computed",
        "append_tokens",
        "at_length",
        "finish",
        "has_unfinished",
        "_finish_reason",
    },
    llm_module.__file__: {"generate", "_run", "_add"},
    run_ahead.__file__: None,  # async scheduling (make_llm(ahead=True))
}

BASE = random_prompts([9], seed=11)[0]
PROMPTS = [BASE + tail for tail in random_prompts([1, 6, 11], seed=12)]  # a shared 9-token prefix
PARAMS = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_k=20, seed=3),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
]


class LineTrace:
    """Counts executed lines of ``FILES``; raises ``exc`` at hit ``hit`` of line ``line`` if given."""

    def __init__(self, line: tuple[str, int] | None = None, hit: int = 0, exc: type[BaseException] = KeyboardInterrupt):
        self.hits: Counter = Counter()
        self.line, self.hit, self.exc = line, hit, exc
        self.fired = False

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if code.co_filename not in FILES or code.co_name not in (FILES[code.co_filename] or {code.co_name}):
            return None
        if event == "line":
            key = (frame.f_code.co_filename, frame.f_lineno)
            self.hits[key] += 1
            if not self.fired and key == self.line and self.hits[key] == self.hit:
                self.fired = True
                raise self.exc()
        return self

    def run(self, fn):
        sys.settrace(self)
        try:
            return fn()
        finally:
            sys.settrace(None)


def assert_pools_consistent(engine) -> None:
    """Reference counts equal holders, the free list is the pages without one, rows are each held once."""
    sched, pages, alloc, rows = engine.scheduler, engine.pages, engine.allocator, engine.req_pool
    live = list(sched.running) + list(sched.waiting)
    assert len({id(s) for s in live}) == len(live), "a sequence in two queues"
    holders = Counter(p for seq in live for p in seq.pages) + Counter(pages.cache.values())
    assert [alloc.ref_count(p) for p in range(alloc.num_pages)] == [holders[p] for p in range(alloc.num_pages)]
    assert sorted(alloc._free) == [p for p in range(alloc.num_pages) if holders[p] == 0]
    cached = set(pages.cache.values())  # the cache's marks, and the pages it alone holds
    assert [alloc._cached[p] for p in range(alloc.num_pages)] == [p in cached for p in range(alloc.num_pages)]
    assert alloc.num_evictable == sum(holders[p] == 1 for p in cached)
    held = [seq.req_pool_idx for seq in sched.running]
    assert None not in held and all(seq.req_pool_idx is None and not seq.pages for seq in sched.waiting)
    scratch = [engine.runner.scratch_row] if engine.runner.scratch_row is not None else []
    assert sorted(rows._free + held + scratch) == list(range(rows.req_to_token.shape[0]))
    assert set(engine.requests.values()) == set(live)
    for seq in sched.running:  # each page of a running sequence is where its row says
        row = rows.req_to_token[seq.req_pool_idx]
        assert [int(row[p * rows.page_size]) // rows.page_size for p in range(len(seq.pages))] == seq.pages
        assert len(seq.pages) * rows.page_size >= seq.num_computed


def make_llm(ckpt_root, ahead: bool = False) -> LLM:
    """``ahead``: with async scheduling, over the captured-step buffers run eagerly."""
    # 9 pages of 4 tokens hold two of the requests: admissions wait, decodes preempt, and the
    # prefix cache is evicted from.
    llm = LLM(
        checkpoint("llama", ckpt_root),
        page_size=4,
        num_pages=9,
        max_model_len=36,
        max_num_seqs=3,
        chunked_prefill_size=8,
        enable_prefix_caching=True,
        enforce_eager=ahead,
    )
    if ahead:
        llm.engine.runner.enable_graphs(batch_size_buckets(3), capture=False, feed=True).capture_all()
        llm.engine.run_ahead = run_ahead.RunAhead(llm.engine)
    return llm


def generate(llm: LLM, cold: bool = False) -> list[list[int]]:
    """The tokens of ``PROMPTS``; ``cold`` empties the prefix cache first, so that the run (and the
    lines it executes) is the same every time. Later prompts still find the first ones' pages."""
    if cold:
        llm.engine.pages.clear_cache()
    return [out.token_ids for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(
    "module,ahead",
    [(m, False) for m in (paging, page_manager, scheduler, req_pool, engine_module, llm_module)] + [(run_ahead, True)],
    ids=lambda v: v.__name__.rsplit(".", 1)[-1] if hasattr(v, "__name__") else ("ahead" if v else "sync"),
)
def test_an_interrupt_at_any_line_of_generate_leaves_the_pools_exact(module, ahead, ckpt_root):
    llm = make_llm(ckpt_root, ahead)
    want = generate(llm)
    if ahead:
        assert want == generate(make_llm(ckpt_root)) and llm.engine.run_ahead.steps_ahead > 0
    assert generate(llm) == want  # served partly from the prefix cache: the same tokens
    tracer = LineTrace()
    cached, preempted = llm.engine.pages.num_cached_tokens, llm.engine.scheduler.num_preemptions
    assert tracer.run(lambda: generate(llm, cold=True)) == want
    assert llm.engine.scheduler.num_preemptions > preempted and llm.engine.pages.num_cached_tokens > cached
    lines = sorted((line, count) for line, count in tracer.hits.items() if line[0] == module.__file__)
    assert lines
    rng = random.Random(0)
    for i, (line, count) in enumerate(lines):
        hit = rng.randint(1, count)
        exc = KeyboardInterrupt if i % 2 == 0 else MemoryError
        with pytest.raises(exc):
            LineTrace(line, hit, exc).run(lambda: generate(llm, cold=True))
        where = f"{exc.__name__} at hit {hit} of {line[0].rsplit('/', 1)[-1]}:{line[1]}"
        assert not llm.engine.has_unfinished(), where
        assert_pools_consistent(llm.engine)
        assert generate(llm) == want, where
        assert generate(llm) == want, where


def test_an_interrupted_schedule_resumes_with_the_same_tokens(ckpt_root):
    """An exception inside ``schedule()`` aborts nothing: stepping on gives the uninterrupted tokens."""
    llm = make_llm(ckpt_root)
    want = generate(llm)
    engine = llm.engine
    schedule = engine.scheduler.schedule

    def run(trace: LineTrace) -> list[list[int]]:
        engine.pages.clear_cache()
        seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        engine.scheduler.schedule = lambda: trace.run(schedule)
        try:
            while engine.has_unfinished():
                try:
                    engine.step()
                except (KeyboardInterrupt, MemoryError):
                    assert_pools_consistent(engine)  # and step again: nothing was aborted
        finally:
            del engine.scheduler.schedule
        assert_pools_consistent(engine)
        return [seq.output_token_ids for seq in seqs]

    probe = LineTrace()
    assert run(probe) == want
    rng = random.Random(1)
    for i, (line, count) in enumerate(sorted(probe.hits.items())):
        trace = LineTrace(line, rng.randint(1, count), KeyboardInterrupt if i % 2 else MemoryError)
        assert run(trace) == want, f"interrupt at {line[0].rsplit('/', 1)[-1]}:{line[1]}"
        assert trace.fired


def test_an_error_while_adding_requests_leaves_none_queued(ckpt_root, monkeypatch):
    llm = make_llm(ckpt_root)
    add, calls = llm.engine.add_request, []

    def add_request(*args, **kwargs):  # the third request fails as it is queued
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError
        return add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", add_request)
    with pytest.raises(MemoryError):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert_pools_consistent(llm.engine)
    assert llm.engine.req_pool.num_free == 3 and llm.engine.allocator.num_free == 9
