"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole, or streamed as server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Errors are
OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for values the engine refuses, 401
without the API key, 404 for an unknown model or route, 422 for a body that does not parse (the
field named in ``param``), 503 with ``Retry-After`` while ``max_queue`` requests wait. A client that
disconnects has its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.input_processor import InputProcessor
from ..engine.outputs import CompletionOutput, RequestOutput
from ..engine.sampling_params import SamplingParams
from .async_engine import AsyncEngine, RequestStream
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, param_of

logger = logging.getLogger("portattn")
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class Server:
    """The handlers' shared state: the engine front, a tokenizer of its own, metrics, settings."""

    def __init__(self, async_engine: AsyncEngine, processor: InputProcessor, model_name: str, api_key: str | None):
        self.engine = async_engine
        self.processor = processor
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = ServerMetrics(async_engine, model_name)
        self.max_len = async_engine.engine.max_len
        self.created = int(time.time())

    # -- checks ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        try:
            ids = self.processor.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.engine.check_prompt(ids)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt", code="invalid_value") from None
        return ids

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """``max_tokens``, or what the context leaves when it is None; 400 if the two do not fit."""
        room = self.max_len - prompt_len
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_len} tokens; the prompt has {prompt_len} "
                f"and {param} asks for {max_tokens} more",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens

    def check_params(self, params: SamplingParams) -> None:
        try:
            self.engine.engine.check_params(params)
        except ValueError as err:
            raise APIError(400, str(err), param=param_of(str(err)), code="invalid_value") from None

    def submit(self, prefix: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams) -> RequestStream:
        if not self.engine.alive:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_dead")
        if self.engine.queue_full():
            raise APIError(
                503,
                f"the server is at its queue limit of {self.engine.max_queue} waiting requests; retry later",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return self.engine.submit(f"{prefix}-{uuid.uuid4().hex}", prompts, params)

    # -- token accounting --------------------------------------------------------------------

    def observe(self, stream: RequestStream, arrival: float) -> Timing:
        return Timing(self.metrics, arrival, stream.num_prompts)


class Timing:
    """Per HTTP request: TTFT, inter-token latency and token counts for the metrics."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompts: int):
        self.metrics = metrics
        self.arrival = arrival
        self.last: list[float | None] = [None] * num_prompts
        self.completion_tokens = 0

    def step(self, index: int, out: RequestOutput) -> None:
        now = time.perf_counter()
        new = sum(len(c.token_ids) for c in out.outputs)
        self.completion_tokens += new
        m = self.metrics
        if new:
            m.labelled(m.generation_tokens).inc(new)
            last = self.last[index]
            if last is None:
                m.labelled(m.ttft).observe(now - self.arrival)
            else:  # one step: one more token per running choice
                m.labelled(m.itl).observe(now - last)
            self.last[index] = now
        for c in out.outputs:
            if c.finish_reason is not None:
                m.requests.labels(model_name=m.model_name, finished_reason=c.finish_reason).inc()
        if out.finished:
            m.labelled(m.e2e).observe(now - self.arrival)


ENGINE_WATCH_S = 0.5  # how often the server looks whether its engine thread still runs


async def _exit_when_engine_dies(server: Server, app: FastAPI) -> None:
    """When the engine thread ends on an error (a failed step; under tensor parallelism, a rank that
    died or stopped answering), log it and call ``app.state.exit_server`` (``portattn serve`` sets it:
    the server exits with status 1, for a supervisor to restart it). Without it the app answers 503."""
    while server.engine.alive:
        await asyncio.sleep(ENGINE_WATCH_S)
    error = server.engine.error
    if error is None:  # stopped by shutdown
        return
    exit_server = getattr(app.state, "exit_server", None)
    then = "the server exits" if exit_server is not None else "requests are answered 503 from now on"
    logger.critical("the engine died (%s: %s); %s", type(error).__name__, error, then)
    if exit_server is not None:
        exit_server()


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not server.engine.alive:
            server.engine.start()
        watch = asyncio.create_task(_exit_when_engine_dies(server, app))
        yield
        watch.cancel()
        server.engine.shutdown()

    app = FastAPI(title="portattn", lifespan=lifespan)
    app.state.server = server

    async def authorized(request: Request) -> None:
        if server.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {server.api_key}".encode()):
            raise APIError(
                401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, err: RequestValidationError):
        first = err.errors()[0]
        # Drop "body" and the union members' tags ("str", "list[int]", ...): the field's path remains.
        loc = [str(x) for x in first.get("loc", ())[1:] if not _is_type_tag(x)]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return JSONResponse(APIError(400, "the body is not valid JSON", code="json_invalid").body(), 400)
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(APIError(422, message, param=param, code=first.get("type")).body(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return JSONResponse(APIError(err.status_code, str(err.detail), code=code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception):
        logger.exception("request failed")
        body = APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return JSONResponse(APIError(503, "the engine is not running", type="server_error").body(), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "portattn",
            "root": server.engine.engine.config.model,
            "max_model_len": server.max_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.check_model(body.model)
        body.check_supported()
        prompts = []
        for prompt in body.prompts():
            ids = server.token_ids(prompt)
            prompts.append((prompt if isinstance(prompt, str) else None, ids))
        max_tokens = body.max_tokens or 16
        for _, ids in prompts:
            server.check_length(len(ids), max_tokens, "max_tokens")
        params = body.sampling_params(max_tokens, body.logprobs)
        server.check_params(params)
        stream = server.submit("cmpl", prompts, params)
        timing = server.observe(stream, arrival)
        usage = _usage(sum(len(ids) for _, ids in prompts), 0)
        server.metrics.labelled(server.metrics.prompt_tokens).inc(usage["prompt_tokens"])
        created = int(time.time())
        head = {"id": stream.request_id, "object": "text_completion", "created": created, "model": server.model_name}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_completion_chunks(stream, timing, head, params.n, usage, include_usage))
        await _collect(stream, timing, request)
        choices = []
        for i, state in enumerate(stream.states):
            out = state.output()
            for c in out.outputs:
                choice = _completion_choice(i * params.n + c.index, c, {})
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(out)
                choices.append(choice)
        usage["completion_tokens"] = sum(s.num_output_tokens for st in stream.states for s in st.seqs)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {**head, "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.check_model(body.model)
        body.check_supported()
        try:
            text, ids = server.processor.chat(
                body.message_dicts(),
                chat_template=body.chat_template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
            server.engine.engine.check_prompt(ids)
        except ValueError as err:
            raise APIError(400, str(err), param="messages", code="invalid_value") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
        max_tokens = server.check_length(len(ids), limit, param)
        params = body.sampling_params(max_tokens, body.num_logprobs())
        server.check_params(params)
        stream = server.submit("chatcmpl", [(text, ids)], params)
        timing = server.observe(stream, arrival)
        usage = _usage(len(ids), 0)
        server.metrics.labelled(server.metrics.prompt_tokens).inc(len(ids))
        head = {
            "id": stream.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_name,
        }
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_chat_chunks(stream, timing, head, params, usage, include_usage))
        await _collect(stream, timing, request)
        out = stream.states[0].output()
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c, params.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ]
        usage["completion_tokens"] = sum(len(c.token_ids) for c in out.outputs)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        result = {**head, "choices": choices, "usage": usage}
        if out.prompt_logprobs is not None:
            result["prompt_logprobs"] = _prompt_logprobs(out)
        return result

    return app


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "StreamOptions"}


# -- responses ------------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(stream: RequestStream, timing: Timing, request: Request) -> None:
    """Wait for the whole output; a client that disconnects first has its request aborted."""

    async def consume() -> None:
        async for index, out in stream:
            timing.step(index, out)

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise APIError(499, "the client closed the request", code="client_closed")
        work.result()  # re-raises an engine error
    except ValueError as err:
        raise APIError(400, str(err), param=param_of(str(err))) from None
    finally:
        work.cancel()
        gone.cancel()
        stream.abort()


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except (APIError, ValueError, RuntimeError) as err:
            error = err if isinstance(err, APIError) else APIError(500, str(err), type="server_error")
            yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _completion_chunks(
    stream: RequestStream, timing: Timing, head: dict, n: int, usage: dict, include_usage: bool
) -> AsyncIterator[dict]:
    offsets: dict[int, int] = {}
    try:
        async for i, out in stream:
            timing.step(i, out)
            choices = []
            for c in out.outputs:
                choice = _completion_choice(i * n + c.index, c, offsets)
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(out)
                choices.append(choice)
            yield {**head, "choices": choices}
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(usage["prompt_tokens"], timing.completion_tokens)}
    finally:
        stream.abort()


async def _chat_chunks(
    stream: RequestStream, timing: Timing, head: dict, params: SamplingParams, usage: dict, include_usage: bool
) -> AsyncIterator[dict]:
    head = {**head, "object": "chat.completion.chunk"}
    try:
        first = {"role": "assistant", "content": ""}
        yield {
            **head,
            "choices": [{"index": i, "delta": first, "logprobs": None, "finish_reason": None} for i in range(params.n)],
        }
        async for i, out in stream:
            timing.step(i, out)
            choices = [
                {
                    "index": c.index,
                    "delta": {"content": c.text} if c.text or c.finish_reason is None else {},
                    "logprobs": _chat_logprobs(c, params.logprobs),
                    "finish_reason": c.finish_reason,
                    **({"stop_reason": c.stop_reason} if c.finish_reason is not None else {}),
                }
                for c in out.outputs
            ]
            yield {**head, "choices": choices}
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(usage["prompt_tokens"], timing.completion_tokens)}
    finally:
        stream.abort()


def _completion_choice(index: int, c: CompletionOutput, offsets: dict[int, int]) -> dict:
    return {
        "index": index,
        "text": c.text,
        "logprobs": _completion_logprobs(c, offsets, index),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _completion_logprobs(c: CompletionOutput, offsets: dict[int, int], index: int) -> dict | None:
    """The legacy completions format: parallel lists per token, ``text_offset`` into the choice's text."""
    if c.logprobs is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = offsets.get(index, 0)
    for token, entry in zip(c.token_ids, c.logprobs):
        chosen = entry[token]
        out["tokens"].append(chosen.decoded_token)
        out["token_logprobs"].append(_lp(chosen.logprob))
        out["top_logprobs"].append({e.decoded_token: _lp(e.logprob) for e in entry.values()})
        out["text_offset"].append(offset)
        offset += len(chosen.decoded_token or "")
    offsets[index] = offset
    return out


def _chat_logprobs(c: CompletionOutput, k: int | None) -> dict | None:
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


def _prompt_logprobs(out: RequestOutput) -> list:
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
            for t, e in entry.items()
        }
        for entry in out.prompt_logprobs
    ]
