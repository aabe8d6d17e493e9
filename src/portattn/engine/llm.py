"""``portattn.LLM``: offline batched generation over the engine, whole or streamed."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from ..errors import is_int
from ..logs import configure_default_logging
from ..models.base import MultimodalModel
from ..validation import check_pixel_values
from .arguments import check_keywords, describe, keyword_signature
from .build import build_engine
from .config import EngineConfig
from .input_processor import InputProcessor
from .metrics import Metric, engine_metrics
from .outputs import CompletionOutput, RequestOutput, RequestState
from .sampling_params import SamplingParams
from .sequence import Sequence

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]


class LLM:
    """A paged inference engine over a Hugging Face checkpoint directory.

    Example::

        llm = portattn.LLM("/path/to/checkpoint")   # or a model id in the local Hugging Face cache
        out = llm.generate(["Hello"], portattn.SamplingParams(max_tokens=32))
        print(out[0].outputs[0].text)   # or out[0].text, the first choice's

    By default the engine runs on the accelerator if there is one (else the CPU), in the checkpoint's
    dtype there (float32 on the CPU), with a KV cache sized from the device's free memory
    (``gpu_memory_utilization``); the start-up line at INFO says what it chose.

    ``tensor_parallel_size=N`` shards the model over N devices, one process each, started here and
    stopped by :meth:`shutdown` (or ``with LLM(...) as llm:``, or at interpreter exit).
    """

    def __init__(self, model: str, **engine_args):
        configure_default_logging()
        check_keywords(EngineConfig, engine_args, what="LLM")
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    # help(LLM) and editors show EngineConfig's fields as the keywords, with their help text.
    __init__.__signature__ = keyword_signature(EngineConfig, leading=("self", "model"))
    __init__.__doc__ = "Keyword arguments (the fields of EngineConfig):\n\n" + describe(EngineConfig)

    def get_tokenizer(self):
        """The checkpoint's tokenizer (a transformers tokenizer), or ``None`` when it has none."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters a request gets when it sets none: vLLM's defaults, with the sampling values
        of the checkpoint's ``generation_config.json`` (temperature, top_p, top_k, min_p,
        repetition_penalty; none with ``generation_config="vllm"``). A request's unset fields take
        the same values, so ``generate(prompts)`` equals ``generate(prompts, this)``."""
        return SamplingParams().with_defaults(self.engine.sampling_defaults)

    @functools.cached_property
    def processor(self) -> InputProcessor:
        """Prompts and chat messages -> token ids (+ images), for this model."""
        return InputProcessor(self.engine.model, self.tokenizer, self.config.model)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt: a str, token ids (a list, or a 1-D integer NumPy array or tensor),
        or a dict ``{"prompt_token_ids": [...], "multi_modal_data": {...}}`` (``"prompt": str`` in place
        of the ids). One :class:`RequestOutput` per prompt, in order, each with ``n`` choices in ``outputs``.
        ``sampling_params``: one for all prompts or one per prompt; ``None`` is ``SamplingParams()``
        (vLLM's defaults, with the checkpoint's where its ``generation_config.json`` has them: see
        :meth:`get_default_sampling_params`).

        ``multi_modal_data`` (multimodal models) is either the Hugging Face image processor's outputs,
        ``{"pixel_values": [N, patch_dim], "image_grid_thw": [num_images, 3]}``, with one run of image
        pad tokens per image in the prompt, as many as its merged patches (``t * h * w / merge**2``);
        or ``{"image": img or [img, ...]}`` (PIL images or arrays) processed with the checkpoint's
        image processor, where a single pad token per image is widened to its patch count.

        The progress bar counts finished prompts and shows the prompt (input) and generated (output)
        tokens per second, as vLLM's does.
        """
        requests = self._prepare(prompts, sampling_params)
        states: list[RequestState] = []
        for _ in self._run(requests, states, use_tqdm):
            pass
        return [state.output() for state in states]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations through the checkpoint's chat template.

        ``messages`` is one conversation (a list of ``{"role", "content"}`` dicts) or a list of them;
        one :class:`RequestOutput` per conversation. Content is a str or a list of parts: text parts
        and, for multimodal models, image parts (``{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}`` or ``{"type": "image", "image": pil_image}``), processed with the
        checkpoint's image processor. The template's own special tokens are kept and none is added
        (no second BOS). A checkpoint without a chat template raises ``ValueError`` unless
        ``chat_template`` (a Jinja string) is given; ``chat_template_kwargs`` are extra template
        variables (Qwen3's ``enable_thinking``, say).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.processor.chat(
                c,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            for c in conversations
        ]
        inputs = [
            {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
            for _, ids, images in prompts
        ]
        requests = self._prepare(inputs, sampling_params)
        requests = [(text, ids, mm, sp) for (text, _, _), (_, ids, mm, sp) in zip(prompts, requests)]
        states: list[RequestState] = []
        for _ in self._run(requests, states, use_tqdm):
            pass
        return [state.output() for state in states]

    def stream(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Generate as :meth:`generate` does, yielding after each engine step a delta
        :class:`RequestOutput` for each request that advanced: its ``outputs`` hold the choices with
        something new, each with only the new ``text`` / ``token_ids`` / ``logprobs`` (joined, they are
        :meth:`generate`'s); ``finish_reason`` is set on a choice's last delta and ``finished`` on the
        request's. Prompts are checked when this is called; generation runs as the iterator is consumed,
        and leaving the loop early aborts what is unfinished.
        """
        requests = self._prepare(prompts, sampling_params)
        for *_, sp in requests:
            if sp.num_seqs > sp.n:
                what = "best_of == n in a stream (the best are known at the end)"
                raise ValueError(f"expected {what}, got best_of {sp.best_of} with n {sp.n}")

        def deltas() -> Iterator[RequestOutput]:
            states: list[RequestState] = []
            run = self._run(requests, states, use_tqdm=False)
            try:
                for _ in run:
                    for state in states:
                        out = state.output(delta=True)
                        if out is not None:
                            yield out
            finally:
                # Closed here rather than when collected, so the aborts happen as the stream is left
                # (under Python 3.12 they had not yet happened when `close()` returned).
                run.close()

        return deltas()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, as vLLM's ``LLM.get_metrics()`` returns them (objects with ``.name``
        and ``.value`` or ``.values``, see :mod:`portattn.engine.metrics`): running and waiting
        sequences, KV-cache use, preemptions, token counts, prefix-cache hits and, with
        ``speculative_config``, ``portattn:spec_decode_num_drafts``, ``..._num_draft_tokens``,
        ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``."""
        return engine_metrics(self.engine)

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel processes (they also stop at interpreter exit).
        Safe to call twice; the ``LLM`` cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw) -> torch.Tensor:
        """Merged image embeddings ``[sum(t * h * w) / merge**2, hidden]``, images in input order.

        ``pixel_values [N, patch_dim]`` and ``image_grid_thw [num_images, 3]`` as the Hugging Face
        image processor returns them (``N = sum(t * h * w)``).
        """
        model = self.engine.model
        if not isinstance(model, MultimodalModel):
            raise ValueError(f"expected a multimodal model for images, got {type(model).__name__}")
        check_pixel_values(pixel_values)
        with torch.inference_mode():
            return model.encode_images(pixel_values.to(self.config.device), image_grid_thw)

    # -- requests ----------------------------------------------------------------------------

    def _prepare(self, prompts, sampling_params) -> list[tuple]:
        """``(prompt text or None, token ids, images, params)`` per prompt, all checked before any is queued."""
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"expected {len(prompts)} sampling params (one per prompt), got {len(params)}")
        requests = []
        for prompt, sp in zip(prompts, params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"expected SamplingParams, got {type(sp).__name__}")
            ids, mm = self.processor.process(prompt)
            ids = self.engine.prepare_prompt(ids, sp, mm)
            self.engine.check_params(sp)
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            requests.append((text, ids, mm, sp))
        return requests

    def _add(self, requests: list[tuple], added: list[Sequence]) -> list[RequestState]:
        """Queue ``requests``; each sequence is recorded in ``added`` as it is queued (one step, see
        ``Engine.add_request``), so that an exception part way leaves nothing unaccounted for."""
        states = []
        for text, ids, mm, sp in requests:
            seqs = [self.engine.add_request(ids, sp, mm, index=i, added=added) for i in range(sp.num_seqs)]
            states.append(RequestState(str(next(self._ids)), text, seqs, self.processor.token_text))
        return states

    def _run(self, requests: list[tuple], states: list[RequestState], use_tqdm: bool) -> Iterator[None]:
        """Queue ``requests`` (their states appended to ``states``) and step the engine until they
        finish, yielding after each step; on exit (finished, interrupted, abandoned, or an error while
        queueing) nothing of theirs stays queued and no page stays held."""
        engine = self.engine
        added: list[Sequence] = []
        try:
            states.extend(self._add(requests, added))
            prompt_start, out_start = engine.num_prompt_tokens_computed, engine.num_generated_tokens
            start = time.perf_counter()
            with tqdm(total=len(states), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
                done = 0
                while done < len(states):
                    engine.step()
                    now = sum(state.finished for state in states)
                    if use_tqdm:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        tok_in = (engine.num_prompt_tokens_computed - prompt_start) / elapsed
                        tok_out = (engine.num_generated_tokens - out_start) / elapsed
                        bar.set_postfix_str(f"input: {tok_in:.2f} toks/s, output: {tok_out:.2f} toks/s", refresh=False)
                        bar.update(now - done)
                    done = now
                    yield
        finally:
            for seq in added:
                if seq.request_id in engine.requests:
                    engine.abort(seq.request_id)


def _is_token_ids(prompt) -> bool:
    """One prompt of token ids (a list of ints, or a 1-D array or tensor), not a list of prompts."""
    if isinstance(prompt, list):
        return bool(prompt) and is_int(prompt[0])
    return getattr(prompt, "ndim", None) == 1
