"""vLLM-shaped outputs on a tiny model with a real tokenizer: stop strings and stop tokens, n choices,
log-probabilities against the engine's logits, chat templates without a second BOS, streaming."""

from __future__ import annotations

import functools

import pytest
import torch

from portattn.engine import detokenizer
from portattn.engine.detokenizer import IncrementalDetokenizer, library_decode
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.testing.chat import save_tiny_chat_checkpoint

PROMPTS = ["The quick brown fox", "Servers stream tokens to", "At the café"]


@functools.cache
def _checkpoint(root: str, chat_template: bool = True) -> str:
    return save_tiny_chat_checkpoint(f"{root}/chat{int(chat_template)}", chat_template=chat_template)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(_checkpoint(str(tmp_path_factory.mktemp("tiny"))), page_size=4, num_pages=256, max_model_len=1024)


def greedy(llm: LLM, prompt: str, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_text_is_the_decoded_tokens(llm):
    for prompt in PROMPTS:
        out = greedy(llm, prompt)
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) and out.text
        assert out.finish_reason == "length" and out.stop_reason is None


def split_stop(llm: LLM, token_ids: list[int]) -> tuple[str, int]:
    """A stop string that starts inside one token and ends inside a later one, and where it starts."""
    pieces = [llm.tokenizer.decode(token_ids[: i + 1]) for i in range(len(token_ids))]
    for i in range(len(pieces) - 1):
        start, end = len(pieces[i - 1]), len(pieces[i])
        if end - start >= 2 and pieces[-1].startswith(pieces[i + 1]):
            stop = pieces[i + 1][end - 1 : end + 1]  # last char of token i, first of token i + 1
            if len(stop) == 2 and "\ufffd" not in stop and pieces[-1].find(stop) == end - 1:
                return stop, end - 1
    pytest.fail("no stop string across a token boundary in this output")


def test_stop_string_across_tokens_cuts_exactly(llm):
    full = greedy(llm, PROMPTS[0])
    stop, at = split_stop(llm, full.token_ids)
    out = greedy(llm, PROMPTS[0], stop=["never there", stop])
    assert out.text == full.text[:at] and out.finish_reason == "stop" and out.stop_reason == stop
    # Generation stopped at the token that completed the stop string.
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert llm.tokenizer.decode(out.token_ids[:-1]).find(stop) < 0 <= llm.tokenizer.decode(out.token_ids).find(stop)
    kept = greedy(llm, PROMPTS[0], stop=stop, include_stop_str_in_output=True)
    assert kept.text == full.text[: at + len(stop)] and kept.token_ids == out.token_ids
    # Not before min_tokens: a match inside the first min_tokens tokens does not stop it.
    late = greedy(llm, PROMPTS[0], stop=stop, min_tokens=len(out.token_ids))
    assert len(late.token_ids) > len(out.token_ids)


def test_stop_token_ids_keep_the_token_but_not_its_text(llm):
    full = greedy(llm, PROMPTS[1])
    token = full.token_ids[5]
    first = full.token_ids.index(token)
    out = greedy(llm, PROMPTS[1], stop_token_ids=[token])
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == token
    assert out.text == llm.tokenizer.decode(full.token_ids[:first])
    banned = greedy(llm, PROMPTS[1], stop_token_ids=[token], min_tokens=first + 2)
    assert token not in banned.token_ids[: first + 2]


def test_n_choices_are_reproducible_with_a_seed(llm):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[1], PROMPTS[0]], params, use_tqdm=False)[1]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    one = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert one.token_ids == a.outputs[0].token_ids  # choice 0 is the n = 1 request


def test_logprobs_equal_log_softmax_of_the_engine_logits(llm):
    params = SamplingParams(
        n=2,
        max_tokens=8,
        temperature=0.8,
        seed=3,
        logprobs=4,
        prompt_logprobs=3,
        return_logits=True,
        return_prompt_logits=True,
        ignore_eos=True,
    )
    out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    for choice in out.outputs:
        want = torch.log_softmax(choice.logits.double(), -1)  # [len(token_ids), V]
        assert len(choice.logprobs) == len(choice.token_ids)
        for pos, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs)):
            assert next(iter(entry)) == token
            assert entry[token].logprob == pytest.approx(float(want[pos, token]), abs=1e-5)
            assert entry[token].rank == int((want[pos] > want[pos, token]).sum()) + 1
            top = torch.topk(want[pos], 4).indices.tolist()
            assert set(entry) == {token, *top} and [entry[t].rank for t in top] == [1, 2, 3, 4]
            assert entry[token].decoded_token == llm.tokenizer.decode([token])
        total = sum(e[t].logprob for t, e in zip(choice.token_ids, choice.logprobs))
        assert choice.cumulative_logprob == pytest.approx(total)
    prompt = out.prompt_token_ids
    want = torch.log_softmax(out.prompt_logits.double(), -1)  # position p scores prompt token p + 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry[prompt[p]].logprob == pytest.approx(float(want[p - 1, prompt[p]]), abs=1e-5)
        assert len(entry) in (3, 4)


def test_chat_uses_the_template_without_a_second_bos(llm, tmp_path_factory):
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered and rendered.startswith("<|bos|><|system|>")
    assert out.prompt_token_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1 and out.prompt_token_ids[0] == tok.bos_token_id
    assert tok(rendered)["input_ids"][:2] == [tok.bos_token_id] * 2  # what a naive tokenize would do
    assert (
        out.token_ids == llm.generate([out.prompt_token_ids], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    )
    batch = llm.chat([messages, messages[1:]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(batch) == 2 and batch[0].token_ids == out.token_ids[:2]
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        llm.chat([{"content": "no role"}])
    bare = LLM(
        _checkpoint(str(tmp_path_factory.mktemp("bare")), chat_template=False),
        page_size=4,
        num_pages=32,
        max_model_len=128,
    )
    with pytest.raises(ValueError, match="chat template"):
        bare.chat(messages)


def test_stream_deltas_join_into_the_whole_output(llm):
    stop, _ = split_stop(llm, greedy(llm, PROMPTS[0]).token_ids)
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop=stop, ignore_eos=True),
        SamplingParams(n=2, max_tokens=9, temperature=1.0, seed=5, logprobs=1, ignore_eos=True),
    ]
    prompts = PROMPTS[:2]
    whole = llm.generate(prompts, params, use_tqdm=False)
    joined = {}
    finished = set()
    for delta in llm.stream(prompts, params):
        for c in delta.outputs:
            text, ids, lps, reason = joined.get((delta.request_id, c.index), ("", [], [], None))
            assert reason is None  # nothing after a choice's final delta
            lps = lps + c.logprobs if c.logprobs else lps
            joined[(delta.request_id, c.index)] = (text + c.text, ids + c.token_ids, lps, c.finish_reason)
        if delta.finished:
            finished.add(delta.request_id)
    assert len(finished) == 2
    streamed = sorted(joined.items())
    flat = [c for out in whole for c in out.outputs]
    assert [(t, ids, r) for _, (t, ids, _, r) in streamed] == [(c.text, c.token_ids, c.finish_reason) for c in flat]
    # The same tokens and ranks; the values as close as two runs of the engine compute them (the second
    # run's prompts come from the prefix cache: on a GPU its logits may differ in the last bits).
    for (_, (_, _, got, _)), want in zip(streamed[1:], [c.logprobs for c in flat][1:], strict=True):
        assert [{t: lp.rank for t, lp in row.items()} for row in got] == [
            {t: lp.rank for t, lp in row.items()} for row in want
        ]
        values = [[lp.logprob for row in rows for lp in row.values()] for rows in (got, want)]
        assert values[0] == pytest.approx(values[1], abs=1e-4)


def test_leaving_a_stream_early_frees_everything(llm):
    it = llm.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_used == len(llm.engine.pages.cache)  # the prefix cache's pages alone


def test_leaving_a_stream_aborts_at_once_whoever_holds_its_run(llm, monkeypatch):
    """The stream closes the engine loop it runs when it is left, rather than leaving that to the
    loop's collection (which a reference elsewhere delays; under Python 3.12 the requests were still
    queued when ``close()`` returned)."""
    held = []
    run = LLM._run

    def holding(self, *args, **kwargs):
        gen = run(self, *args, **kwargs)
        held.append(gen)
        return gen

    monkeypatch.setattr(LLM, "_run", holding)
    it = llm.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    assert held and not llm.engine.requests and not llm.engine.has_unfinished()


@pytest.mark.parametrize("library", [True, False], ids=["library-decode", "tokenizer-decode"])
def test_incremental_text_equals_decode(llm, library, monkeypatch):
    """With the tokenizers library's decode (the fast tokenizer's default) and with transformers'."""
    tok = llm.tokenizer
    if not library:
        monkeypatch.setattr(detokenizer, "library_decode", lambda *args: None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (400,), generator=g).tolist()  # stray bytes and special tokens too
    for skip in (True, False):
        for read_every_token in (True, False):  # a stream's reads, or none until the end (generate)
            detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=skip))
            assert (detok._library_decode is not None) == library
            for i, t in enumerate(ids):
                detok.append(t)
                if read_every_token:  # what a stream reads each step: all but an incomplete last character
                    so_far = tok.decode(ids[: i + 1], skip_special_tokens=skip)
                    assert so_far.startswith(detok.text)
                    if not so_far.endswith("\ufffd"):
                        assert detok.text == so_far
            detok.flush()
            assert detok.text == tok.decode(ids, skip_special_tokens=skip)
            assert detok.read_offset == len(ids)
    assert "<|end|>" in tok.decode(ids, skip_special_tokens=False)
    held = IncrementalDetokenizer(tok, SamplingParams(stop=["abcd", "xy"]))
    for t in tok("hello world", add_special_tokens=False)["input_ids"]:
        held.append(t)
    assert held.streamable(False) == len("hello world") - 3 and held.streamable(True) == len("hello world")


def test_bad_stop_token_ids_and_prompts_raise(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate("hi", {"max_tokens": 3})
    assert not llm.engine.requests


def test_steps_do_not_copy_the_generated_tokens(llm, monkeypatch):
    """A step's checks and a stream's deltas count the outputs without copying them, so the host's work
    per step does not grow with the output's length."""
    from portattn.engine.sequence import Sequence

    copies = []
    monkeypatch.setattr(Sequence, "output_token_ids", property(lambda seq: copies.append(seq) or []))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["never printed"])
    whole = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    deltas = list(llm.stream(["Once upon a time"], params))
    assert not copies
    assert len(whole.token_ids) == 40 and sum(len(d.outputs[0].token_ids) for d in deltas) == 40


def test_library_decode_only_where_it_is_the_tokenizers_own(llm):
    """Not where the tokenizer cleans up spaces or overrides decode: then transformers decodes."""
    tok = llm.tokenizer
    assert library_decode(tok, True) is not None
    assert library_decode(object(), True) is None
    cleaning = type(tok).from_pretrained(llm.config.model, clean_up_tokenization_spaces=True)
    assert library_decode(cleaning, True) is None
    overriding = type("Overriding", (type(tok),), {"decode": lambda self, ids, **kwargs: "x"})
    assert library_decode(overriding.from_pretrained(llm.config.model), True) is None
