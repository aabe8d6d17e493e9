"""Request preprocessing off the event loop: chat templates, tokenization, images and the length
check run on one worker thread, so that a long prompt or a slow template delays only the requests
queued behind it, never the streams in flight or ``/health``.

One thread, because a tokenizer is not safe to share between threads; the engine thread has its
own. Errors that the request caused (``ValueError``, ``TypeError``, ``RuntimeError`` and Jinja's
``TemplateError``, which a template's ``raise_exception`` raises) become 400s naming the field.

Completions whose prompts are all token ids for a text model (without ``echo``) are checked on the event
loop instead (:meth:`Preprocessor.ids_only`, :meth:`Preprocessor.run_now`): no tokenizer is involved and the
checks are a few passes in C over the ids, while the hop to the thread and back puts each request behind
every request that arrives meanwhile. A burst of 256 requests of 1,024 ids (on a CPU) reached the engine
only once the last of them had been parsed; checked in place, each goes on as it is parsed.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jinja2

from ..engine.engine import Engine
from ..engine.input_processor import InputProcessor
from ..models.base import MultimodalModel
from .async_engine import Prompt
from .protocol import APIError

PREPROCESSING_ERRORS = (ValueError, TypeError, RuntimeError, jinja2.TemplateError)


@dataclass(frozen=True)
class Echo:
    """What ``echo`` puts before a completion: the prompt's text and its first token's text (the
    first entry of the echoed log-probabilities, which has no log-probability)."""

    text: str
    first_token: str


def context_length_error(max_model_len: int, prompt_len: int, completion: int, param: str) -> APIError:
    """The one wording of a request that does not fit the context (OpenAI's error code)."""
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens (--max-model-len). However, you requested "
        f"{prompt_len + completion} tokens ({prompt_len} in the prompt, {completion} for the completion). "
        "Please reduce the length of the prompt or of the completion.",
        param=param,
        code="context_length_exceeded",
    )


class Preprocessor:
    """Runs preprocessing functions on the worker thread (:meth:`run`); the functions below are
    what the routes run there."""

    def __init__(self, processor: InputProcessor, engine: Engine):
        self.processor = processor
        self.engine = engine  # read only: its limits and checks, which touch no engine state
        self.max_model_len = engine.max_model_len
        self.multimodal = isinstance(processor.model, MultimodalModel)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portattn-preprocess")

    async def run(self, param: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the worker thread; an error the request caused -> 400 on ``param``."""
        work = functools.partial(self.run_now, param, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def ids_only(self, prompts: list) -> bool:
        """Whether ``prompts`` are all token ids for a text model: :meth:`completion_prompts` then needs no
        tokenizer (without ``echo``) and :meth:`run_now` may run it on the event loop."""
        return not self.multimodal and all(isinstance(p, list) for p in prompts)  # (the schema's list[int])

    def run_now(self, param: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on this thread (for work that needs no tokenizer; :meth:`run` calls it on the
        worker's); an error the request caused -> 400 on ``param``."""
        try:
            return fn(*args, **kwargs)
        except APIError:
            raise
        except PREPROCESSING_ERRORS as err:
            raise APIError(400, _describe(err), param=param, code="invalid_value") from None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- on the worker thread ----------------------------------------------------------------

    def fit(self, prompt_len: int, max_tokens: int | None, param: str, prompt_param: str) -> int:
        """``max_tokens``, or what the context leaves when it is None; the request must fit."""
        completion = 1 if max_tokens is None else max_tokens
        if prompt_len + completion > self.max_model_len:
            where = prompt_param if prompt_len >= self.max_model_len else param
            raise context_length_error(self.max_model_len, prompt_len, completion, where)
        return self.max_model_len - prompt_len if max_tokens is None else max_tokens

    def completion_prompts(self, prompts: list, max_tokens: int, echo: bool) -> tuple[list[Prompt], list[Echo]]:
        """Each prompt (a str or token ids) checked and tokenized; with ``echo``, what each echoes."""
        out, echoes = [], []
        for prompt in prompts:
            ids, multimodal = self.processor.process(prompt)
            self.fit(len(ids), max_tokens, "max_tokens", "prompt")
            self.engine.check_prompt(ids)
            out.append(Prompt(prompt if isinstance(prompt, str) else None, ids, multimodal))
            if echo:
                echoes.append(Echo(prompt if isinstance(prompt, str) else self.decode(ids), self.token_text(ids[0])))
        return out, echoes

    def chat_prompt(self, messages: list[dict], max_tokens: int | None, param: str, **template) -> tuple[Prompt, int]:
        """One conversation through the chat template (with its images) and the tokens it may generate."""
        text, ids, images = self.processor.chat(messages, **template)
        ids, multimodal = self.with_images(ids, images)
        max_tokens = self.fit(len(ids), max_tokens, param, "messages")
        self.engine.check_prompt(ids)
        return Prompt(text, ids, multimodal), max_tokens

    def with_images(self, ids: list[int], images: list):
        """``(token ids, images)`` as the engine takes them: placeholders widened to the images' sizes,
        and the checks of a multimodal model's prompt (no stray placeholders) made."""
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        return self.processor.process(prompt)

    def tokenize(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool | None, **template):
        """``/tokenize``: the ids the engine would see (a chat's images widened to their patch counts)."""
        if prompt is not None:
            return self.processor.tokenize(prompt, add_special_tokens=add_special_tokens is not False)
        text, ids, images = self.processor.chat(messages, **template)
        if add_special_tokens:
            ids = self.processor.tokenize(text, add_special_tokens=True)
        return self.with_images(ids, images)[0]

    def decode(self, ids: list[int]) -> str:
        if self.processor.tokenizer is None:
            raise ValueError("expected a model directory with a tokenizer to turn token ids into text, got none")
        vocab = self.engine.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"expected token ids in [0, {vocab}), got {ids[bad]} at index {bad}")
        return self.processor.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.processor.token_text(token_id)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.processor.token_text(t) for t in ids]


def _describe(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    if isinstance(err, jinja2.TemplateError):
        return f"the chat template failed: {type(err).__name__}: {text}"
    return text
