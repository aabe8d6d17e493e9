"""Response bodies: whole responses, server-sent event streams (one choice per chunk, as OpenAI's
API sends them) and the two log-probability formats (completions' parallel lists, chat's entries)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from ..engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ..engine.sampling_params import SamplingParams
from .async_engine import RequestStream
from .metrics import Timing
from .preprocess import Echo
from .protocol import APIError, param_of

logger = logging.getLogger("portattn")

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """``data: {json}`` per event, then ``data: [DONE]``; an error ends the stream as an error event
    (the status line, 200, has gone already)."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as err:  # every error reaches the client as OpenAI's error body
            if isinstance(err, APIError):
                error = err
            elif isinstance(err, ValueError):  # the engine refused the request, as _collect answers it
                error = APIError(400, str(err), param=param_of(str(err)), code="invalid_value")
            elif isinstance(err, RuntimeError):  # the engine failed
                error = APIError(500, str(err), type="server_error")
            else:  # a defect of the server, as the non-streaming routes' 500 handler logs it
                logger.exception("request failed")
                error = APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")
            yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class CompletionFormat:
    """Choices of ``/v1/completions``: ``index = prompt * n + choice``, text offsets kept per choice
    across a stream's chunks, and with ``echo`` the prompt before a choice's first text. ``prompt_only``
    (``max_tokens=0`` with ``echo``): the prompt alone, the token computed after it left out, finish reason
    ``length``."""

    def __init__(self, n: int, echoes: list[Echo] | None, prompt_logprobs: bool, *, prompt_only: bool = False):
        if prompt_only and echoes is None:
            raise ValueError("expected the echoed prompts with prompt_only, got none")
        self.n = n
        self.prompt_only = prompt_only
        self.echoes = echoes
        self.prompt_logprobs = prompt_logprobs  # the request asked for the prompt_logprobs field
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()
        self.prompt_entries: dict[int, list] = {}  # per prompt: its log-probabilities, from the first delta

    def choices(self, prompt: int, out: RequestOutput) -> list[dict]:
        if out.prompt_logprobs is not None:
            self.prompt_entries.setdefault(prompt, out.prompt_logprobs)
        return [self.choice(prompt, out, c) for c in out.outputs]

    def choice(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> dict:
        index = prompt * self.n + c.index
        text, echoed_logprobs = ("" if self.prompt_only else c.text), None
        if self.echoes and index not in self.echoed:
            self.echoed.add(index)
            echo = self.echoes[prompt]
            text = echo.text + text
            if c.logprobs is not None:
                entries = self.prompt_entries[prompt]  # a stream sends them once per prompt
                echoed_logprobs = _echoed_logprobs(echo, out.prompt_token_ids, entries)
                self.offsets[index] = echoed_logprobs.pop("end")
        if self.prompt_only:
            logprobs = None if c.logprobs is None else echoed_logprobs or _no_logprobs()
            finish_reason, stop_reason = ("length" if c.finish_reason is not None else None), None
        else:
            logprobs = _completion_logprobs(c, self.offsets, index)
            if echoed_logprobs is not None:
                logprobs = {key: echoed_logprobs[key] + logprobs[key] for key in logprobs}
            finish_reason, stop_reason = c.finish_reason, c.stop_reason
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.prompt_logprobs and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(out)
        return choice


async def completion_chunks(
    stream: RequestStream, timing: Timing, head: dict, fmt: CompletionFormat, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[dict]:
    """The chunks of a streamed completion, one choice each; the request is aborted and its timing
    closed however the stream ends (finished, the client gone, the server stopping)."""
    try:
        async for i, out in stream:
            timing.step(i, out)
            for choice in fmt.choices(i, out):
                yield {**head, "choices": [choice]}
        if include_usage:
            completion_tokens = 0 if fmt.prompt_only else timing.completion_tokens
            yield {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
    finally:
        stream.abort()
        timing.close()


async def chat_chunks(
    stream: RequestStream,
    timing: Timing,
    head: dict,
    params: SamplingParams,
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[dict]:
    """The chunks of a streamed chat completion, one choice each: every choice's role first, then
    its deltas."""
    head = {**head, "object": "chat.completion.chunk"}
    try:
        for i in range(params.n):
            first = {"role": "assistant", "content": ""}
            yield {**head, "choices": [{"index": i, "delta": first, "logprobs": None, "finish_reason": None}]}
        async for i, out in stream:
            timing.step(i, out)
            for c in out.outputs:
                choice = {
                    "index": c.index,
                    "delta": {"content": c.text} if c.text or c.finish_reason is None else {},
                    "logprobs": chat_logprobs(c, params.logprobs),
                    "finish_reason": c.finish_reason,
                    **({"stop_reason": c.stop_reason} if c.finish_reason is not None else {}),
                }
                yield {**head, "choices": [choice]}
        if include_usage:
            yield {**head, "choices": [], "usage": usage(prompt_tokens, timing.completion_tokens)}
    finally:
        stream.abort()
        timing.close()


def chat_choice(c: CompletionOutput, k: int | None) -> dict:
    return {
        "index": c.index,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": chat_logprobs(c, k),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _no_logprobs() -> dict:
    """The legacy completions format's log-probabilities of no token."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _completion_logprobs(c: CompletionOutput, offsets: dict[int, int], index: int) -> dict | None:
    """The legacy completions format: parallel lists per token, ``text_offset`` into the choice's text."""
    if c.logprobs is None:
        return None
    out = _no_logprobs()
    offset = offsets.get(index, 0)
    for token, entry in zip(c.token_ids, c.logprobs):
        offset = _append(out, entry[token], entry, offset)
    offsets[index] = offset
    return out


def _echoed_logprobs(echo: Echo, prompt_ids: list[int], entries: list[PositionLogprobs | None]) -> dict:
    """The prompt's tokens in the completions format: the first has no log-probability (None)."""
    out = {"tokens": [echo.first_token], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    offset = len(echo.first_token)
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        offset = _append(out, entry[token], entry, offset)
    out["end"] = offset
    return out


def _append(out: dict, chosen, entry: PositionLogprobs, offset: int) -> int:
    out["tokens"].append(chosen.decoded_token)
    out["token_logprobs"].append(_lp(chosen.logprob))
    out["top_logprobs"].append({e.decoded_token: _lp(e.logprob) for e in entry.values()})
    out["text_offset"].append(offset)
    return offset + len(chosen.decoded_token or "")


def chat_logprobs(c: CompletionOutput, k: int | None) -> dict | None:
    if c.logprobs is None or k is None:
        return None
    content = []
    for token, entry in zip(c.token_ids, c.logprobs):
        chosen = entry[token]
        top = sorted((e for e in entry.values() if e.rank <= k), key=lambda e: e.rank)[:k]
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": _lp(chosen.logprob),
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [
                    {
                        "token": e.decoded_token,
                        "logprob": _lp(e.logprob),
                        "bytes": list((e.decoded_token or "").encode()),
                    }
                    for e in top
                ],
            }
        )
    return {"content": content}


def prompt_logprobs(out: RequestOutput) -> list:
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
            for t, e in entry.items()
        }
        for entry in out.prompt_logprobs
    ]
