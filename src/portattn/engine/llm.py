"""``portattn.LLM``: offline batched generation over the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import Engine
from .sampling_params import SamplingParams
from .sequence import Sequence


@dataclass
class RequestOutput:
    """One finished request. ``token_ids`` are the generated tokens (an end-of-sequence token included)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logits: torch.Tensor | None = None  # [len(token_ids), V] float32, with SamplingParams(return_logits=True)
    prompt_logits: torch.Tensor | None = None  # [len(prompt), V], with return_prompt_logits=True


class LLM:
    """A paged inference engine over a Hugging Face checkpoint directory.

    Example::

        llm = portattn.LLM(model="/path/to/checkpoint", device="cpu", dtype="float32", page_size=16)
        out = llm.generate(["Hello"], portattn.SamplingParams(max_tokens=32))
        print(out[0].text)
    """

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "float32",
        page_size: int = 16,
        attention_backend: str = "auto",
        mm_attention_backend: str = "auto",
        max_num_seqs: int = 64,
        num_pages: int | None = None,
        chunked_prefill_size: int | None = None,
        enable_prefix_caching: bool = False,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
    ):
        self.config = EngineConfig(
            model=str(model),
            device=device,
            dtype=dtype,
            page_size=page_size,
            attention_backend=attention_backend,
            mm_attention_backend=mm_attention_backend,
            max_num_seqs=max_num_seqs,
            num_pages=num_pages,
            chunked_prefill_size=chunked_prefill_size,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
        )
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a str, a list of token ids, or ``{"prompt_token_ids": [...]}``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"expected {len(prompts)} sampling params (one per prompt), got {len(params)}")
        token_ids = [self._token_ids(p) for p in prompts]
        for ids in token_ids:  # all prompts are checked before any is queued
            self.engine.check_prompt(ids)
        seqs = [self.engine.add_request(ids, sp) for ids, sp in zip(token_ids, params)]
        try:
            with tqdm(total=len(seqs), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished():
                    bar.update(len(self.engine.step()))
        finally:  # an interrupted call leaves nothing queued and no pages held
            for seq in seqs:
                if seq.request_id in self.engine.requests:
                    self.engine.abort(seq.request_id)
        return [self._output(seq) for seq in seqs]

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("expected token-id prompts: the model directory has no tokenizer, got a str")
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:
                raise ValueError(f"expected a text-only prompt for {type(self.engine.model).__name__}, got images")
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"expected a dict with 'prompt_token_ids', got keys {sorted(prompt)}")
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise ValueError(f"expected a prompt as str, list[int] or dict, got {type(prompt).__name__}")

    def _output(self, seq: Sequence) -> RequestOutput:
        tokens = seq.output_token_ids
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=tokens,
            text=text,
            finish_reason=seq.finish_reason,
            logits=torch.stack(seq.logits) if seq.logits else None,
            prompt_logits=torch.cat(seq.prompt_logits) if seq.prompt_logits else None,
        )
