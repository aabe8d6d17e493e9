"""Continuous batching: preemption, page accounting, aborts, token budgets, prefix sharing, EOS."""

from __future__ import annotations

import random

import pytest

from portattn import to_page_table
from portattn.engine.forward_batch import ForwardBatch
from portattn.engine.llm import LLM
from portattn.engine.page_manager import PageManager
from portattn.engine.req_pool import ReqToTokenPool
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.scheduler import Scheduler
from portattn.engine.sequence import Sequence, Status
from portattn.paging import PageAllocator
from tiny_models import checkpoint, hf_reference, random_prompts, scheduled_token_counts

PROMPTS = random_prompts([3, 9, 17, 26, 31, 40], seed=1)
MAX_NEW = 16


def used_by_sequences(llm: LLM) -> int:
    return len({p for seq in llm.engine.scheduler.running for p in seq.pages} | set(llm.engine.pages.cache.values()))


@pytest.mark.parametrize("prefix", [False, True], ids=["noprefix", "prefix"])
@pytest.mark.parametrize("family", ["llama", "llama4"])
def test_small_pool_preempts_and_gives_the_same_tokens(family, prefix, ckpt_root):
    path = checkpoint(family, ckpt_root)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    seeded = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_k=50, seed=7)
    params = [greedy, seeded] * 3
    big = LLM(path, page_size=4, num_pages=200, max_model_len=64, max_num_seqs=8, enable_prefix_caching=prefix)
    small = LLM(
        path, page_size=4, num_pages=16, max_model_len=64, max_num_seqs=8, enable_prefix_caching=prefix
    )  # 64 slots
    want = [o.token_ids for o in big.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.token_ids for o in small.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert small.engine.scheduler.num_preemptions > 0
    assert big.engine.scheduler.num_preemptions == 0
    for i in (0, 2, 4):  # greedy rows equal transformers
        assert got[i] == hf_reference(path, tuple(PROMPTS[i]), MAX_NEW)[0]
    small.engine.pages.clear_cache()
    assert small.engine.allocator.num_free == 16
    assert small.engine.req_pool.num_free == 8


def test_pages_are_accounted_every_step_and_aborts_free_them(ckpt_root):
    llm = LLM(
        checkpoint("qwen3", ckpt_root),
        page_size=3,
        num_pages=60,
        max_model_len=180,
        max_num_seqs=4,
        chunked_prefill_size=16,
    )
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert engine.allocator.num_used == used_by_sequences(llm)
        assert len(engine.scheduler.running) <= 4
        if steps == 3:
            victim = engine.scheduler.running[0]
            assert victim.pages
            engine.abort(victim.request_id)
            assert victim.finish_reason == "abort" and victim.pages == [] and victim.req_pool_idx is None
    engine.pages.clear_cache()  # prefix caching is on by default: the cache alone holds pages now
    assert engine.allocator.num_free == 60 and engine.req_pool.num_free == 4
    with pytest.raises(ValueError, match="expected the id of an unfinished request"):
        engine.abort(seqs[0].request_id)
    assert sorted(len(s.output_token_ids) for s in seqs if s.finish_reason == "length") == [12] * 5


def test_token_budget_and_batch_modes(ckpt_root, monkeypatch):
    llm = LLM(checkpoint("llama", ckpt_root), page_size=5, num_pages=100, max_model_len=500, chunked_prefill_size=10)
    batches = []
    build = ForwardBatch.build

    def record(scheduled, *args, **kwargs):
        batches.append([(seq.num_computed, n) for seq, n in scheduled])
        out = build(scheduled, *args, **kwargs)
        batches[-1] = (out.mode, batches[-1])
        return out

    monkeypatch.setattr(ForwardBatch, "build", staticmethod(record))
    prompts = [PROMPTS[5], PROMPTS[0], PROMPTS[1]]  # 40 tokens: four chunks, then 3 and 9 beside decodes
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(sum(n for _, n in sched) <= 10 for _, sched in batches)
    modes = [mode for mode, _ in batches]
    assert modes[:5] == ["prefill", "extend", "extend", "extend", "mixed"] and modes[-1] == "decode"
    assert batches[4][1] == [(40, 1), (0, 3), (0, 6)]
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_reference(llm.config.model, tuple(prompt), 6)[0]


def test_prefix_cache_shares_physical_pages(ckpt_root):
    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=64, max_model_len=256, enable_prefix_caching=True)
    engine = llm.engine
    base = PROMPTS[5][:12]  # three full pages
    llm.generate([[*base, 1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    a = engine.add_request([*base, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    b = engine.add_request([*base, 4, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    assert a.pages[:3] == b.pages[:3] and a.pages[3] != b.pages[3]
    assert all(engine.allocator.ref_count(p) == 3 for p in a.pages[:3])  # two sequences and the cache
    rows = engine.req_pool.req_to_token[[a.req_pool_idx, b.req_pool_idx], :16]
    table = to_page_table(rows, 4, seq_lens=rows.new_tensor([a.num_computed, b.num_computed]), check=True)
    assert table[0, :3].tolist() == table[1, :3].tolist() == a.pages[:3]
    assert engine.pages.num_cached_tokens == 24
    while engine.has_unfinished():
        engine.step()
    assert all(engine.allocator.ref_count(p) == 1 for p in engine.pages.cache.values())


def test_stops_at_eos_unless_ignored(ckpt_root):
    path = checkpoint("llama4", ckpt_root)
    llm = LLM(path, page_size=8, num_pages=50, max_model_len=400)
    tokens = hf_reference(path, tuple(PROMPTS[2]), MAX_NEW)[0]
    eos = tokens[4]
    llm.engine.eos_token_ids = {eos}
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
    assert out.token_ids == tokens[: tokens.index(eos) + 1] and out.finish_reason == "stop"
    out = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.token_ids == tokens and out.finish_reason == "length"
    assert llm.engine.allocator.num_used == len(llm.engine.pages.cache)  # what the prefix cache keeps


def test_context_limit_finishes_with_length(ckpt_root):
    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=5, max_model_len=20)
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 20 - len(PROMPTS[2]) and out.finish_reason == "length"
    with pytest.raises(ValueError, match="shorter than max_model_len 20"):
        llm.generate([PROMPTS[0], PROMPTS[3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the valid prompt before it was not queued either


def test_proposals_give_way_before_a_preemption():
    """With speculative decoding, an older sequence's proposed tokens never cost a newer one its place:
    the pages they would need go back before anything is preempted (and the budget gets their tokens)."""
    size = 4
    pages = PageManager(PageAllocator(5), ReqToTokenPool(3, 32, size, "cpu"), enable_prefix_caching=False)
    scheduler = Scheduler(pages, max_num_seqs=2, max_num_batched_tokens=16)
    old, new = Sequence(0, [1] * 7, SamplingParams(temperature=0)), Sequence(1, [2] * 8, SamplingParams(temperature=0))
    for seq in (old, new):
        scheduler.add(seq)
    assert [n for _, n in scheduler.schedule()] == [7, 8]  # 2 pages each, 1 free
    for seq in (old, new):  # in decode: old's next token fits its pages, new's needs the free page
        seq.num_computed = seq.num_tokens
        seq.token_ids.append(3)
    scheduler.lookahead = lambda seq: 3  # old alone could take the free page for its proposals
    assert scheduler.schedule() == [(old, 1), (new, 1)]
    assert scheduler.num_preemptions == 0 and len(old.pages) == 2 and len(new.pages) == 3
    assert pages.allocator.num_free == 0
    # With pages to spare, the proposals run.
    scheduler.finish(new, "stop")
    assert scheduler.schedule() == [(old, 4)] and len(old.pages) == 3


def test_prefix_cache_hits_count_admissions_not_attempts(ckpt_root):
    """A waiting sequence whose cached prefix matches but whose other pages do not fit yet is tried
    again each step: the hits count once, when it is admitted."""
    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=10, max_model_len=40, max_num_seqs=4)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = PROMPTS[5][:12]
    llm.generate([[*base, 1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # 3 pages cached
    before = engine.pages.num_cached_tokens
    engine.add_request(PROMPTS[4][:18], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # 5 pages of 7
    engine.step()
    waiting = engine.add_request([*base, *PROMPTS[3][:13]], params)  # its 3 cached pages and 4 more
    steps = 0
    while True:
        computed = engine.num_prompt_tokens_computed
        engine.step()
        if waiting.status is not Status.WAITING:
            break
        steps += 1
        assert engine.pages.num_cached_tokens == before  # its prefix matched in this step, yet it waits
    assert steps >= 2
    # Admitted: what the cache served and what the model computed of its prompt add up to the prompt.
    hits = engine.pages.num_cached_tokens - before
    assert hits == 12  # its 3 cached pages, once
    assert hits + engine.num_prompt_tokens_computed - computed == waiting.num_prompt_tokens
    while engine.has_unfinished():
        engine.step()


def test_a_step_with_nothing_to_do_runs_no_forward(ckpt_root):
    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=16, max_model_len=32)
    engine = llm.engine
    assert engine.step() == []  # a fresh engine
    seq = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.step() == [] and len(seq.output_token_ids) == 2
    assert engine.num_generated_tokens == 2


def test_a_step_scheduled_ahead_decodes_the_tokens_in_flight():
    """``schedule_ahead``: sequences whose next token is in flight (``num_computed == num_tokens``)
    decode it (one token, its slot reserved) before prompt chunks and admissions share the budget; a
    sequence with its token in flight that is not fed (it stops with that token) is left out; where
    the step would preempt, nothing is scheduled or admitted (None) and the synchronous schedule
    preempts as usual."""
    size = 4
    pages = PageManager(PageAllocator(7), ReqToTokenPool(4, 32, size, "cpu"), enable_prefix_caching=False)
    scheduler = Scheduler(pages, max_num_seqs=4, max_num_batched_tokens=10)
    greedy = SamplingParams(temperature=0)
    a, b, c = (Sequence(i, [i + 1] * n, greedy) for i, n in enumerate((4, 7, 12)))
    for seq in (a, b, c):
        scheduler.add(seq)
    assert scheduler.schedule() == [(a, 4), (b, 6)]  # c waits: no budget left
    for seq, n in ((a, 4), (b, 6)):
        seq.num_computed += n
    # a's next token is in flight (its one page is full: the token's slot needs a second page); b has one
    # prompt token left; c is admitted with what is left of the budget.
    assert scheduler.schedule_ahead([a]) == [(a, 1), (b, 1), (c, 8)]
    assert len(a.pages) == 2 and a.num_tokens == 4 and c.status is Status.RUNNING
    for seq, n in ((a, 1), (b, 1), (c, 8)):
        seq.num_computed += n
    a.token_ids.append(9)  # a's token is read; b's first token and a's next are in flight; a stops with it
    b.token_ids.append(9)
    assert scheduler.schedule_ahead([b]) == [(b, 1), (c, 4)]  # a left out
    for seq, n in ((b, 1), (c, 4)):
        seq.num_computed += n
    free = pages.allocator.num_free
    scheduler.finish(a, "length")
    assert pages.allocator.num_free == free + 2
    # A pool too short for the next chunk: the synchronous schedule would preempt, the one ahead declines.
    waiting = Sequence(3, [5] * 3, greedy)
    scheduler.add(waiting)
    c.token_ids += [7] * 20  # more to compute than the free pages hold
    running = list(scheduler.running)
    assert scheduler.schedule_ahead([b]) is None
    assert scheduler.running == running and list(scheduler.waiting) == [waiting] and scheduler.num_preemptions == 0
    b.token_ids.append(9)  # b's token read: the synchronous schedule preempts c, the newest
    assert scheduler.schedule() == [(b, 1)] and scheduler.num_preemptions == 1 and c.status is Status.WAITING


def capped_scheduler(budget: int, cap: int, lengths, max_num_seqs: int = 4, shared: int = 0, partial: int = 0):
    """Prompts of ``lengths`` tokens, the first ``shared`` of each alike (prefix caching on where ``shared``), at
    most ``partial`` of them unfinished a step (0: no limit)."""
    pool = ReqToTokenPool(max_num_seqs, 128, 4, "cpu")
    pages = PageManager(PageAllocator(400), pool, enable_prefix_caching=shared > 0)
    scheduler = Scheduler(
        pages, max_num_seqs, budget, long_prefill_token_threshold=cap, max_num_partial_prefills=partial
    )
    tokens = [[99] * min(n, shared) + [i + 1] * (n - min(n, shared)) for i, n in enumerate(lengths)]
    seqs = [Sequence(i, t, SamplingParams(temperature=0)) for i, t in enumerate(tokens)]
    for seq in seqs:
        scheduler.add(seq)
    return scheduler, seqs


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    """``long_prefill_token_threshold``: where the step has room to spare, a prompt (admitted or already
    running) computes at most that many tokens a step, decodes are not capped, and several capped prompts
    share the budget."""
    scheduler, (a, b, c, d) = capped_scheduler(32, 5, (12, 3, 9, 5))
    assert scheduler.schedule() == [(a, 5), (b, 3), (c, 5), (d, 5)]  # 18 tokens of 32
    for seq, n in ((a, 5), (b, 3), (c, 5), (d, 5)):
        seq.num_computed += n
    b.token_ids.append(9)  # b decodes; the others go on in chunks of at most 5
    assert scheduler.schedule() == [(b, 1), (a, 5), (c, 4)]
    wanted = r"long_prefill_token_threshold \(--long-prefill-token-threshold\) to be an int >= 0, got -1"
    with pytest.raises(ValueError, match=wanted):
        LLM("unused", long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match=r"\(--max-num-partial-prefills\) to be an int >= 0, got -1"):
        LLM("unused", max_num_partial_prefills=-1)


def test_a_full_step_finishes_the_oldest_prompts_instead_of_capping_them():
    """Where the capped chunks would fill the budget anyway, a prompt whose rest fits in what is left
    computes it all (oldest first: the step is as long, the first tokens come sooner), while one too long to
    finish in the step still takes only its capped chunk, so those behind it go on beside it."""
    scheduler, (a, b, c, d) = capped_scheduler(16, 5, (12, 3, 9, 5))  # capped: 5 + 3 + 5 + 5 >= 16
    assert scheduler.schedule() == [(a, 12), (b, 3), (c, 1)]
    scheduler, (a, b, c, d) = capped_scheduler(16, 5, (30, 3, 8, 5))
    assert scheduler.schedule() == [(a, 5), (b, 3), (c, 8)]  # a cannot finish in 16; c's 8 fill what is left
    for seq, n in ((a, 5), (b, 3), (c, 8)):
        seq.num_computed += n
    b.token_ids.append(9)  # b and c decode next
    c.token_ids.append(9)
    assert scheduler.schedule() == [(b, 1), (c, 1), (a, 5), (d, 5)]  # capped: 10 of the 14 left, capped again


@pytest.mark.parametrize("seed", range(40))
def test_capped_steps_are_as_long_as_strictly_capped_ones(seed):
    """Over random queues of prompts and decodes (odd seeds: prompts sharing a cached prefix), a step computes
    exactly the tokens it would if every prompt were capped (the decodes, then the capped chunks of what each
    prompt has left to compute, up to the budget); a prompt computes more than the cap only in a full step, and
    then all that is left of it."""
    random_capped_queue(seed)


def random_capped_queue(seed: int) -> int:
    """:func:`test_capped_steps_are_as_long_as_strictly_capped_ones`' run of one seed; the prompt tokens the
    prefix cache served."""
    rng = random.Random(seed)
    budget, cap = rng.randint(4, 64), rng.randint(1, 20)
    lengths = [rng.randint(1, 90) for _ in range(rng.randint(1, 8))]
    shared = rng.randint(8, 60) if seed % 2 else 0
    scheduler, _ = capped_scheduler(budget, cap, lengths, max_num_seqs=6, shared=shared)
    pages, hits = scheduler.pages, 0
    for _ in range(400):
        if not scheduler.has_unfinished():
            break
        uncomputed = {s: s.num_tokens - s.num_computed for s in scheduler.running}
        admissible = list(scheduler.waiting)[: scheduler.max_num_seqs - len(scheduler.running)]
        decodes = sum(n == 1 for n in uncomputed.values())
        step = scheduler.schedule()
        chosen = dict(step)
        hits += sum(s.num_computed for s in admissible if s in chosen)  # (the prefix cache's tokens)
        capped = sum(min(n, cap) for n in uncomputed.values() if n > 1)
        capped += sum(  # an admitted prompt's after its cache hit; one left waiting, what the cache holds now
            min(s.num_tokens - (s.num_computed if s in chosen else pages.cached_tokens(s)), cap) for s in admissible
        )
        total = sum(chosen.values())
        assert total == min(budget, decodes + capped), (budget, cap, lengths, shared)
        for seq, n in step:
            pending = seq.num_tokens - seq.num_computed
            assert n <= cap or (n == pending and total == budget), (budget, cap, lengths, n, pending)
        for seq, n in step:
            seq.num_computed += n
            pages.commit(seq)
            if seq.num_computed == seq.num_tokens:
                if seq.num_tokens - len(seq.prompt_token_ids) >= 3:
                    scheduler.finish(seq, "length")
                else:
                    seq.token_ids.append(7)
    assert not scheduler.has_unfinished()
    return hits


def advance(step) -> None:
    """Each scheduled sequence computes its tokens; one that finishes its prompt gets a next token."""
    for seq, n in step:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(9)


def test_max_num_partial_prefills_lets_one_prompt_at_a_time_stay_unfinished():
    """``max_num_partial_prefills=1``: one prompt a step takes a chunk that does not finish it (oldest first);
    a prompt whose rest fits in its capped share still finishes beside it, and admission stops at the first
    prompt that would be left unfinished (first come, first served), so later short prompts wait behind it."""
    scheduler, (a, b, c, d) = capped_scheduler(32, 5, (12, 3, 9, 5), partial=1)
    step = scheduler.schedule()
    assert step == [(a, 5), (b, 3)]  # c (9 > 5) would be a second unfinished prompt: it and d wait
    advance(step)
    step = scheduler.schedule()
    assert step == [(b, 1), (a, 5)] and list(scheduler.waiting) == [c, d]
    advance(step)
    assert scheduler.schedule() == [(b, 1), (a, 2), (c, 5), (d, 5)]  # a finishes: c may stay unfinished
    unlimited, (a, b, c, d) = capped_scheduler(32, 5, (12, 3, 9, 5))
    assert unlimited.schedule() == [(a, 5), (b, 3), (c, 5), (d, 5)]


def test_max_num_partial_prefills_keeps_whole_prompts_of_a_full_step():
    """Whether the capped chunks fill the step is decided as without the limit: where they do, prompts that fit
    finish whole (they are not partial) and only the prompts left unfinished count against the limit; the last
    prompt the limit lets go unfinished takes all the step has left (no prompt behind it could take a chunk); a
    running prompt beyond the limit computes nothing that step."""
    scheduler, (a, b, c, d) = capped_scheduler(16, 5, (12, 30, 12, 5), partial=1)  # capped: 20 >= 16
    step = scheduler.schedule()
    assert step == [(a, 12), (b, 4)]  # b cannot finish: the one unfinished prompt; c waits
    advance(step)
    step = scheduler.schedule()
    assert step == [(a, 1), (b, 15)]  # full (5 + 5 + 5 >= 15): b, still the one unfinished, takes the rest
    advance(step)
    step = scheduler.schedule()
    assert step == [(a, 1), (b, 11), (c, 4)]  # b finishes whole (full: 5 + 5 + 5 >= 14), c the unfinished one
    advance(step)
    scheduler.max_partial = 0  # (none may stay unfinished: c, running, computes nothing; d, whole, is admitted)
    assert scheduler.schedule() == [(a, 1), (b, 1), (d, 5)]


def test_max_num_partial_prefills_fills_the_steps_of_a_queue_of_long_prompts():
    """A burst of prompts longer than the room a step has: with one prompt a step left unfinished, every step in
    which the capped chunks would fill the room computes its whole budget, as without the limit (the unfinished
    prompt takes what the capped chunks of the prompts behind it would have: else a queue of long prompts would
    prefill at about one prompt's length a step, whatever the budget)."""
    for partial in (0, 1):
        scheduler, seqs = capped_scheduler(16, 3, [24] * 6, max_num_seqs=6, partial=partial)
        full_steps = 0
        for _ in range(100):
            pending = [seq.num_tokens - seq.num_computed for seq in seqs if not seq.token_ids[24:]]
            if not pending:
                break
            step = scheduler.schedule()
            prompts = [n for seq, n in step if seq.num_tokens - seq.num_computed > 1]
            room = 16 - sum(1 for seq, _ in step if seq.num_tokens - seq.num_computed == 1)
            if sum(min(n, 3) for n in pending) >= room:  # the capped chunks fill the step: it is full
                assert sum(prompts) == room, (partial, step)
                full_steps += 1
            unfinished = sum(n < seq.num_tokens - seq.num_computed for seq, n in step if n > 1)
            assert unfinished <= (partial or 6), (partial, step)
            advance(step)
            for seq, _ in step:
                scheduler.pages.commit(seq)
        assert not pending and full_steps >= 3, (partial, full_steps)  # (every prompt done; the rule exercised)


@pytest.mark.parametrize("seed", range(20))
def test_random_queues_keep_at_most_the_partial_limit_unfinished(seed):
    """Over random queues (odd seeds: prompts sharing a cached prefix), budgets, caps and limits, no step leaves
    more than ``max_num_partial_prefills`` prompts unfinished after computing part of them, every prompt finishes
    (the oldest unfinished one always goes on), no step computes more than the budget, and a prompt computes more
    than the cap only to finish."""
    rng = random.Random(seed)
    budget, cap, limit = rng.randint(4, 64), rng.randint(1, 20), rng.randint(1, 3)
    lengths = [rng.randint(1, 90) for _ in range(rng.randint(1, 8))]
    shared = rng.randint(8, 60) if seed % 2 else 0  # (odd seeds: a cached prefix, which admission counts)
    scheduler, seqs = capped_scheduler(budget, cap, lengths, max_num_seqs=6, shared=shared, partial=limit)
    for _ in range(400):
        if not scheduler.has_unfinished():
            break
        step = scheduler.schedule()
        total = sum(n for _, n in step)
        left = [n < seq.num_tokens - seq.num_computed for seq, n in step if seq.num_tokens - seq.num_computed > 1]
        assert sum(left) <= limit and total <= budget, (budget, cap, limit, lengths)
        over_cap = [n for seq, n in step if cap < n < seq.num_tokens - seq.num_computed]
        # (more than the cap only to finish, or as the one prompt left unfinished that fills the step)
        assert not over_cap or (len(over_cap) == 1 and total == budget), (budget, cap, lengths, step)
        for seq, n in step:
            seq.num_computed += n
            scheduler.pages.commit(seq)
            if seq.num_computed == seq.num_tokens:
                if seq.num_tokens - len(seq.prompt_token_ids) >= 3:
                    scheduler.finish(seq, "length")
                else:
                    seq.token_ids.append(7)
    assert not scheduler.has_unfinished() and all(s.status is Status.FINISHED for s in seqs)


def test_a_step_counts_what_the_prefix_cache_holds_before_taking_prompts_whole():
    """Whether the capped chunks fill the step counts each waiting prompt's tokens less its cached prefix: three
    prompts whose first 24 tokens are cached (2 left each) behind a 30-token one leave a 32-token step room, so
    the long prompt is capped (counted whole, they would seem to fill it, and it would take all 30)."""
    scheduler, (first,) = capped_scheduler(32, 8, [25], shared=24)
    while first.num_computed < first.num_tokens:  # in chunks of 8 (the step has room)
        ((_, n),) = scheduler.schedule()
        first.num_computed += n
        scheduler.pages.commit(first)  # its full pages go to the cache
    scheduler.finish(first, "stop")
    long = Sequence(1, [5] * 30, SamplingParams(temperature=0))
    cached = [Sequence(2 + i, [99] * 24 + [6 + i, 7], SamplingParams(temperature=0)) for i in range(3)]
    for seq in (long, *cached):
        scheduler.add(seq)
    assert [scheduler.pages.cached_tokens(seq) for seq in (long, *cached)] == [0, 24, 24, 24]
    assert scheduler.schedule() == [(long, 8)] + [(seq, 2) for seq in cached]
    assert [seq.num_computed for seq in cached] == [24, 24, 24]


def test_random_queues_meet_the_prefix_cache():
    """(The odd seeds of the test above do serve prompts from the prefix cache.)"""
    assert sum(random_capped_queue(seed) > 0 for seed in range(1, 40, 2)) >= 5


def test_long_prefill_token_threshold_gives_the_same_tokens(ckpt_root):
    """Prompts cut into chunks of 4 tokens beside running decodes give the uncapped engine's tokens, and
    transformers' greedy ones; no step computes more than 4 tokens of one prompt."""
    path = checkpoint("llama", ckpt_root)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    capped = LLM(path, page_size=3, num_pages=200, max_model_len=80, long_prefill_token_threshold=4)
    with scheduled_token_counts() as chunks:
        got = [o.token_ids for o in capped.generate(PROMPTS, params, use_tqdm=False)]
    want = [o.token_ids for o in LLM(path, page_size=3, num_pages=200, max_model_len=80).generate(PROMPTS, params)]
    assert got == want and max(chunks) == 4
    assert capped.engine.describe_load(200).endswith(
        "per step (prompt chunks of at most 4 where the step has room, 1 left unfinished a step at most)"
    )
    for i in (0, 5):
        assert got[i] == hf_reference(path, tuple(PROMPTS[i]), 8)[0]


def test_max_num_partial_prefills_gives_the_same_tokens(ckpt_root):
    """Prompts in chunks of 4 tokens, at most one of them unfinished a step (the default): the uncapped engine's and
    transformers' greedy ones, with steps where a second prompt would have been left unfinished (so the limit
    held something back) and none where it was."""
    path = checkpoint("llama", ckpt_root)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(page_size=3, num_pages=200, max_model_len=80, long_prefill_token_threshold=4)
    unfinished = []
    schedule = Scheduler._schedule

    def record(self, *args, **kwargs):
        step = schedule(self, *args, **kwargs)
        unfinished.append(
            sum(n < s.num_tokens - s.num_computed for s, n in step or () if s.num_tokens - s.num_computed > 1)
        )
        return step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "_schedule", record)
        limited = LLM(path, **options)  # (the default: 1, vLLM's)
        got = [o.token_ids for o in limited.generate(PROMPTS, params, use_tqdm=False)]
        limited_steps, unfinished[:] = list(unfinished), []
        unlimited = LLM(path, max_num_partial_prefills=0, **options)
        unlimited.generate(PROMPTS, params, use_tqdm=False)
    want = [o.token_ids for o in LLM(path, page_size=3, num_pages=200, max_model_len=80).generate(PROMPTS, params)]
    assert got == want and max(limited_steps) == 1 and max(unfinished) > 1
    assert unlimited.engine.describe_load(200).endswith("per step (prompt chunks of at most 4 where the step has room)")
    for i in (0, 5):
        assert got[i] == hf_reference(path, tuple(PROMPTS[i]), 8)[0]
