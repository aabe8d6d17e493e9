"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole, or streamed as server-sent
events ending in ``data: [DONE]``), ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /tokenize``
and ``/detokenize``, ``GET /health``, ``/ping``, ``/version`` and ``/metrics``. Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (the table in docs/serving.md): 400 for a body
that does not parse or values the engine refuses, 401 without the API key (checked first on every
``/v1`` path), 404 for an unknown model or route, 413 for a body over the limit, 503 with
``Retry-After`` while ``max_queue`` requests wait, and while the server stops. A client that
disconnects has its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._version import __version__
from ..engine.sampling_params import SamplingParams
from .async_engine import AsyncEngine, Prompt, RequestStream
from .metrics import ServerMetrics, Timing, log_stats
from .middleware import APIKeyCheck, BodyLimit
from .preprocess import Preprocessor
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    param_of,
)
from .responses import (
    CompletionFormat,
    chat_choice,
    chat_chunks,
    completion_chunks,
    prompt_logprobs,
    sse,
    usage,
)

logger = logging.getLogger("portattn")

_MAX_LOGGED_FIELDS = 256  # unknown field names logged once each, up to this many


class Server:
    """The handlers' shared state: the engine front, the preprocessing thread, metrics, settings."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        preprocessor: Preprocessor,
        model_name: str,
        api_key: str | None,
        *,
        trust_request_chat_template: bool,
        max_request_bytes: int,
        log_stats_interval: float | None,
    ):
        self.engine = async_engine
        self.preprocessor = preprocessor
        self.model_name = model_name
        self.api_key = api_key
        self.trust_request_chat_template = trust_request_chat_template
        self.max_request_bytes = max_request_bytes
        self.log_stats_interval = log_stats_interval
        self.metrics = ServerMetrics(async_engine, model_name)
        self.max_model_len = async_engine.engine.max_model_len
        self.created = int(time.time())
        self.streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()  # submitted, for the shutdown
        self.stopping = False
        self._logged_fields: set[str] = set()

    # -- checks ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def accept(self, body, route: str) -> None:
        """Checks made on the event loop before any preprocessing: the model, unsupported fields,
        room in the queue; fields the API does not know are logged (once per name) and ignored."""
        self.check_model(body.model)
        unknown = [name for name in body.unknown_fields() if name not in self._logged_fields]
        if unknown and len(self._logged_fields) < _MAX_LOGGED_FIELDS:
            self._logged_fields.update(unknown)
            logger.warning("%s: ignoring request fields this server does not know: %s", route, unknown)
        body.check_supported()
        self.check_room()
        self.check_template(body)

    def check_template(self, body) -> None:
        """A template in the request runs only on a server started to trust them."""
        template = getattr(body, "chat_template", None)
        kwargs = getattr(body, "chat_template_kwargs", None)
        in_kwargs = isinstance(kwargs, dict) and "chat_template" in kwargs
        if (template is not None or in_kwargs) and not self.trust_request_chat_template:
            raise APIError(
                400,
                "expected no chat_template in the request: this server renders only its model's template "
                "(start it with --trust-request-chat-template to accept request templates)",
                param="chat_template",
                code="chat_template_not_allowed",
            )

    def check_room(self) -> None:
        if self.stopping:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutdown")
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

    def check_params(self, params: SamplingParams) -> None:
        try:
            self.engine.engine.check_params(params)
        except ValueError as err:
            raise APIError(400, str(err), param=param_of(str(err)), code="invalid_value") from None

    def submit(self, prefix: str, prompts: list[Prompt], params: SamplingParams) -> RequestStream:
        self.check_room()  # again: preprocessing took time
        stream = self.engine.submit(f"{prefix}-{uuid.uuid4().hex}", prompts, params)
        self.streams.add(stream)
        return stream

    def end_streams(self, error: APIError) -> int:
        """End every open request now (its stream gets ``error``, then ``[DONE]``); how many there were."""
        open_streams = [stream for stream in self.streams if not stream.finished]
        for stream in open_streams:
            stream.fail(error)
        return len(open_streams)

    def observe(self, stream: RequestStream, arrival: float, params: SamplingParams) -> Timing:
        # Every sequence is counted by its finish reason (with best_of, the ones not returned too).
        return Timing(self.metrics, arrival, stream.num_prompts, params.num_seqs)

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "portattn",
            "root": self.engine.engine.config.model,
            "max_model_len": self.max_model_len,
        }


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
        stats = None
        if server.log_stats_interval:
            stats = asyncio.create_task(log_stats(server.engine, server.log_stats_interval))
        yield
        watch.cancel()
        if stats is not None:
            stats.cancel()
        server.preprocessor.shutdown()
        server.engine.shutdown()

    app = FastAPI(title="portattn", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=server.max_request_bytes)
    if server.api_key is not None:  # added last: runs first
        app.add_middleware(APIKeyCheck, api_key=server.api_key)
    _add_error_handlers(app)
    pre = server.preprocessor

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            error = APIError(503, "the engine is not running", type="server_error", code="engine_dead")
            return JSONResponse(error.body(), 503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return server.model_card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        body.check_supported()
        server.check_template(body)
        template = _template_args(body) if body.messages is not None else {}
        param = "prompt" if body.prompt is not None else "messages"
        ids = await pre.run(param, pre.tokenize, body.prompt, body.message_dicts(), body.add_special_tokens, **template)
        texts = await pre.run("tokens", pre.token_texts, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": texts}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        return {"prompt": await pre.run("tokens", pre.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.accept(body, "/v1/completions")
        # The prompt alone (max_tokens=0 with echo): one token computed, as vLLM does, and left out of the reply.
        max_tokens = 1 if body.prompt_only else body.max_tokens or 16
        given = body.prompts()
        if body.echo or not pre.ids_only(given):
            prompts, echoes = await pre.run("prompt", pre.completion_prompts, given, max_tokens, body.echo)
        else:  # token ids: checked here, so that the requests reach the engine in the order they came
            prompts, echoes = pre.run_now("prompt", pre.completion_prompts, given, max_tokens, False)
        params = body.sampling_params(max_tokens, body.logprobs)
        server.check_params(params)
        stream = server.submit("cmpl", prompts, params)
        timing = server.observe(stream, arrival, params)
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        server.metrics.labelled(server.metrics.prompt_tokens).inc(prompt_tokens)
        head = {"id": stream.request_id, "object": "text_completion", "created": int(time.time())}
        head["model"] = server.model_name
        fmt = CompletionFormat(
            params.n, echoes if body.echo else None, body.prompt_logprobs is not None, prompt_only=body.prompt_only
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return sse(completion_chunks(stream, timing, head, fmt, prompt_tokens, include_usage))
        await _collect(stream, timing, request)
        choices = [choice for i, state in enumerate(stream.states) for choice in fmt.choices(i, state.output())]
        completion_tokens = 0 if body.prompt_only else sum(s.num_output_tokens for st in stream.states for s in st.seqs)
        return {**head, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.accept(body, "/v1/chat/completions")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
        prompt, max_tokens = await pre.run(
            "messages", pre.chat_prompt, body.message_dicts(), limit, param, **_template_args(body)
        )
        params = body.sampling_params(max_tokens, body.num_logprobs())
        server.check_params(params)
        stream = server.submit("chatcmpl", [prompt], params)
        timing = server.observe(stream, arrival, params)
        prompt_tokens = len(prompt.token_ids)
        server.metrics.labelled(server.metrics.prompt_tokens).inc(prompt_tokens)
        head = {"id": stream.request_id, "object": "chat.completion", "created": int(time.time())}
        head["model"] = server.model_name
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return sse(chat_chunks(stream, timing, head, params, prompt_tokens, include_usage))
        await _collect(stream, timing, request)
        out = stream.states[0].output()
        choices = [chat_choice(c, params.logprobs) for c in out.outputs]
        result = {**head, "choices": choices, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in out.outputs))}
        if out.prompt_logprobs is not None:
            result["prompt_logprobs"] = prompt_logprobs(out)
        return result

    return app


def _template_args(body) -> dict:
    return {
        "chat_template": body.chat_template,
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "chat_template_kwargs": body.chat_template_kwargs,
    }


def _add_error_handlers(app: FastAPI) -> None:
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
        return JSONResponse(APIError(400, message, param=param, code=first.get("type")).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(err.status_code)
        return JSONResponse(APIError(err.status_code, str(err.detail), code=code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception):
        logger.exception("request failed")
        body = APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error").body()
        return JSONResponse(body, status_code=500)


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions"}


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
        work.result()  # re-raises an engine error, or the server's shutdown
    except ValueError as err:
        raise APIError(400, str(err), param=param_of(str(err)), code="invalid_value") from None
    finally:
        work.cancel()
        gone.cancel()
        stream.abort()
        timing.close()
