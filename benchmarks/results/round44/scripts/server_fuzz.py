"""Odd requests to the server (a tiny chat model on the CPU, the test suite's ``running_server``): about 150 bodies
across /v1/completions and /v1/chat/completions (empty, out-of-range, wrong-typed, NaN and infinite fields; odd
prompts and messages; unknown fields and endpoints; bodies that are not JSON objects). Each must get 200, or a 4xx
carrying the OpenAI error JSON, within 20 s. Prints every status with its error message, then the requests that
broke the rule (round 44: none).

    PYTHONPATH=src:tests python benchmarks/results/round44/scripts/server_fuzz.py
"""

import json
import tempfile
import time

import torch

from server.conftest import request, running_server, tiny_checkpoint

torch.set_num_threads(1)
C = "/v1/completions"
CH = "/v1/chat/completions"
base_c = {"prompt": "hello there", "max_tokens": 4}
base_ch = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
cases = []


def c(**kw):
    cases.append((C, {**base_c, **kw}))


def ch(**kw):
    cases.append((CH, {**base_ch, **kw}))


for p in ["", [], [[]], [""], [999999], [-1], [1.5], [[1, 2], "x"], "x" * 5000, [True], None, {"a": 1}]:
    c(prompt=p)
for m in [0, -1, 10**9, "5", None, 1.5, True, 2**63]:
    c(max_tokens=m)
for t in [-1, 1e6, 0, "hot", 1e-9, 2.0000001]:
    c(temperature=t)
for tp in [0, 1.5, -0.1, 1e-12]:
    c(top_p=tp)
for tk in [0, -1, -2, 10**9, 1.5]:
    c(top_k=tk)
for mp in [2, -1, 1]:
    c(min_p=mp)
for n in [0, 2, 1000, -1]:
    c(n=n)
    c(n=n, stream=True)
for bo in [1, 2, 0]:
    c(best_of=bo)
    c(best_of=bo, n=2)
for s in ["", [""], ["a"] * 100, "z" * 10000, [None], 5]:
    c(stop=s)
for lp in [-1, 0, 5, 20, 21, 100, True, None]:
    c(logprobs=lp)
    c(logprobs=lp, echo=True, max_tokens=0)
c(echo=True, max_tokens=0)
c(echo=True, max_tokens=0, stream=True)
for seed in [-1, 2**70, 1.5]:
    c(seed=seed)
for k, v in [("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", -1)]:
    c(**{k: v})
for lb in [{"abc": 1}, {"99999999": 1}, {"1": 1000}, {"1": "x"}, [], {"-5": 1}]:
    c(logit_bias=lb)
c(stream_options={"include_usage": True})
c(stream=True, stream_options={"include_usage": "yes"})
c(stream=True, stream_options={"include_usage": True}, n=2)
c(model="nope")
c(unknown_field=1)
c(suffix="x")
c(user="u")
c(min_tokens=10, max_tokens=2)
c(min_tokens=-1)
c(ignore_eos=True, max_tokens=20)
c(prompt="x " * 2000)  # longer than max_model_len
c(prompt=[[1, 2, 3]] * 40, max_tokens=2)
c(prompt="\ud800 lone surrogate")
for msgs in [
    [],
    [{"role": "user"}],
    [{"role": "alien", "content": "x"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
    [{"role": "user", "content": [{"type": "video"}]}],
    [{"role": "assistant", "content": "x"}],
    [{"role": "system", "content": "s"}],
    "hi",
    [{"content": "x"}],
    [{"role": "user", "content": 5}],
    [{"role": "tool", "content": "x", "tool_call_id": "1"}],
]:
    ch(messages=msgs)
ch(logprobs=True, top_logprobs=25)
ch(logprobs=False, top_logprobs=2)
ch(top_logprobs=-1, logprobs=True)
ch(response_format={"type": "json_object"})
ch(tools=[{"type": "function", "function": {"name": "f"}}])
ch(tool_choice="auto")
ch(max_completion_tokens=3)
ch(max_completion_tokens=-3)
ch(n=2, stream=True)
ch(add_generation_prompt=False)
ch(continue_final_message=True)
ch(echo=True)
ch(stream=True, stream_options={"include_usage": True})
ch(stop=["\n"] * 3)
ch(chat_template="{{ 1/0 }}")
ch(chat_template_kwargs={"enable_thinking": False})
ch(messages=[{"role": "user", "content": "x" * 3000}])

raw = [
    (C, b"not json"),
    (C, b"[1,2]"),
    (C, b""),
    (C, b'{"prompt": NaN, "max_tokens": 2}'),
    (C, b'{"prompt": "a", "temperature": NaN}'),
    (C, b'{"prompt": "a", "max_tokens": Infinity}'),
    (C, b'{"prompt": "a"'),
    (CH, b"null"),
    ("/v1/embeddings", b'{"input": "x"}'),
    ("/v1/models", None),
    ("/v1/nothing", b"{}"),
    ("/tokenize", b'{"prompt": "x"}'),
    ("/detokenize", b'{"tokens": [1, 2, 99999999]}'),
    ("/detokenize", b'{"tokens": [-1]}'),
]

with tempfile.TemporaryDirectory() as root, running_server(tiny_checkpoint(root)) as (url, _):
    bad = []
    for path, body in cases:
        t = time.monotonic()
        try:
            st, out, _ = request(url + path, "POST", json.dumps(body, allow_nan=True).encode(), timeout=60)
        except Exception as e:
            bad.append((path, body, "EXC", repr(e)[:200]))
            continue
        dt = time.monotonic() - t
        ok = st == 200 or (400 <= st < 500 and isinstance(out, dict) and "error" in out and "message" in out["error"])
        if not ok or dt > 20:
            bad.append((path, {k: (str(v)[:60]) for k, v in body.items()}, st, str(out)[:300]))
        else:
            print(
                st,
                path,
                {k: str(v)[:40] for k, v in body.items()},
                "->",
                (out["error"]["message"][:120] if st != 200 else "ok"),
            )
    for path, data in raw:
        try:
            st, out, _ = request(url + path, "POST" if data is not None else "GET", data, timeout=60)
        except Exception as e:
            bad.append((path, data, "EXC", repr(e)[:200]))
            continue
        ok = st == 200 or (400 <= st < 500 and isinstance(out, dict) and "error" in out)
        print(st, path, data, "->", str(out)[:150])
        if not ok:
            bad.append((path, data, st, str(out)[:300]))
    print("\nBAD:", len(bad))
    for b in bad:
        print(b)
