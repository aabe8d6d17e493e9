"""The OpenAI API's request bodies (with vLLM's extra sampling fields) and their mapping to
:class:`SamplingParams`; OpenAI-style error bodies.

Bodies accept fields they do not know (the server logs each such name once and ignores it), as
OpenAI's own API does; a field of the API that this server does not implement is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams

# Fields of the OpenAI API that this server does not implement: a request that sets one gets a 400
# naming it (rather than silently different behaviour). Fields unknown to the API are ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "suffix", "audio", "prediction")


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        # A message may quote the request (a lone surrogate, say), and the body must still encode as UTF-8.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # NaN and infinities (JSON's extensions, which Python's json reads) are refused as such: NaN against a bound
    # would otherwise be told it is below it
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        """The names of fields the model does not declare (kept in ``model_extra``)."""
        return sorted(self.model_extra or ())


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's extras (sent with the client's ``extra_body``).

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left out (or null)
    stay unset in the :class:`SamplingParams`: the engine gives them the checkpoint's
    ``generation_config.json`` values, else vLLM's defaults (``temperature`` 1, as in OpenAI's API)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Present in the OpenAI API, not implemented here (a 400 names them).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    audio: Any = None
    prediction: Any = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    def check_supported(self) -> None:
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias", code="unsupported")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream=true", param="stream_options", code="invalid_value"
            )

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; a value it refuses becomes a 400 naming the field."""
        given = {name: getattr(self, name) for name in GENERATION_CONFIG_FIELDS if getattr(self, name) is not None}
        prompt_logprobs = self.prompt_logprobs
        if getattr(self, "echo", False) and logprobs is not None:  # the echoed prompt's tokens carry theirs
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
        try:
            return SamplingParams(
                n=self.n,
                best_of=getattr(self, "best_of", None),
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                **given,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                stop=self.stop or (),
                stop_token_ids=self.stop_token_ids or (),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as err:
            raise APIError(400, str(err), param=param_of(str(err)), code="invalid_value") from None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or lists of them."""

    # Token ids before lists of strings: pydantic's union tries its members in order, and ``list[str]`` first made
    # a prompt of 1,024 ids take 106 us to validate instead of 12 (a CPU core; the error for a prompt of no
    # listed type still names the string first).
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 with ``echo``: the prompt alone (its log-probabilities with ``logprobs``), as OpenAI's legacy API and vLLM
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)

    @property
    def prompt_only(self) -> bool:
        """``max_tokens=0`` with ``echo``: the reply holds the prompt and no completion."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        if isinstance(prompt[0], int):
            return [prompt]
        if any(isinstance(p, list) and not p for p in prompt):
            raise APIError(400, "prompt must not hold an empty list of token ids", param="prompt", code="invalid_value")
        return list(prompt)

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400,
                "expected max_tokens >= 1, or 0 with echo=true (the prompt alone), got 0",
                param="max_tokens",
                code="invalid_value",
            )
        if self.prompt_only and self.min_tokens:
            raise APIError(
                400,
                f"expected min_tokens 0 with max_tokens=0 (the prompt alone), got {self.min_tokens}",
                param="min_tokens",
                code="invalid_value",
            )
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise APIError(400, "best_of above n cannot be streamed", param="best_of", code="invalid_value")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template as they are

    role: str
    # Text, or parts: {"type": "text", "text"} and {"type": "image_url", "image_url": {"url": "data:..."}},
    # checked by the input processor (shared with LLM.chat), which names the part at fault.
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras for templates.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(
                400, "only response_format {'type': 'text'} is supported", param="response_format", code="unsupported"
            )
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(
                400,
                "give max_tokens or max_completion_tokens, not both",
                param="max_completion_tokens",
                code="invalid_value",
            )

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class TokenizeRequest(_Body):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give prompt or messages, not both or neither", param="prompt", code="invalid_value")

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages or ()]


class DetokenizeRequest(_Body):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def param_of(message: str) -> str | None:
    """The field an engine message names: ``"expected top_k to be ..."`` -> ``"top_k"``."""
    words = message.split()
    if len(words) > 1 and words[0] == "expected":
        name = words[1].rstrip(",:")
        return name if name.isidentifier() else None
    return None
