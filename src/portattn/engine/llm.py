"""``portattn.LLM``: offline batched generation over the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.base import MultimodalModel
from ..runtime.multimodal import MultimodalData
from .arguments import check_keywords, describe, keyword_signature
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

    def __init__(self, model: str, **engine_args):
        check_keywords(EngineConfig, engine_args, what="LLM")
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._image_processor = None  # loaded on the first raw image

    # help(LLM) and editors show EngineConfig's fields as the keywords, with their help text.
    __init__.__signature__ = keyword_signature(EngineConfig, leading=("self", "model"))
    __init__.__doc__ = "Keyword arguments (the fields of EngineConfig):\n\n" + describe(EngineConfig)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt: a str, a list of token ids, or a dict
        ``{"prompt_token_ids": [...], "multi_modal_data": {...}}`` (``"prompt": str`` in place of the ids).

        ``multi_modal_data`` (multimodal models) is either the Hugging Face image processor's outputs,
        ``{"pixel_values": [N, patch_dim], "image_grid_thw": [num_images, 3]}``, with one run of image
        pad tokens per image in the prompt, as many as its merged patches (``t * h * w / merge**2``);
        or ``{"image": img or [img, ...]}`` (PIL images or arrays) processed with the checkpoint's
        image processor, where a single pad token per image is widened to its patch count.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"expected {len(prompts)} sampling params (one per prompt), got {len(params)}")
        requests = [self._request(p) for p in prompts]
        for ids, _ in requests:  # all prompts are checked before any is queued
            self.engine.check_prompt(ids)
        seqs = [self.engine.add_request(ids, sp, mm) for (ids, mm), sp in zip(requests, params)]
        try:
            with tqdm(total=len(seqs), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished():
                    bar.update(len(self.engine.step()))
        finally:  # an interrupted call leaves nothing queued and no pages held
            for seq in seqs:
                if seq.request_id in self.engine.requests:
                    self.engine.abort(seq.request_id)
        return [self._output(seq) for seq in seqs]

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw) -> torch.Tensor:
        """Merged image embeddings ``[sum(t * h * w) / merge**2, hidden]``, images in input order.

        ``pixel_values [N, patch_dim]`` and ``image_grid_thw [num_images, 3]`` as the Hugging Face
        image processor returns them (``N = sum(t * h * w)``).
        """
        model = self._multimodal_model()
        with torch.inference_mode():
            return model.encode_images(pixel_values.to(self.config.device), image_grid_thw)

    def _multimodal_model(self):
        model = self.engine.model
        if not isinstance(model, MultimodalModel):
            raise ValueError(f"expected a multimodal model for images, got {type(model).__name__}")
        return model

    def _request(self, prompt) -> tuple[list[int], MultimodalData | None]:
        """``(token ids, images)`` of one prompt, validated."""
        data = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(
                    "expected a dict with 'prompt_token_ids' or 'prompt' (and optionally 'multi_modal_data'), "
                    f"got keys {sorted(prompt)}"
                )
            data = prompt.get("multi_modal_data")
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("expected token-id prompts: the model directory has no tokenizer, got a str")
            token_ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise ValueError(f"expected a prompt as str, list[int] or dict, got {type(prompt).__name__}")
        if not isinstance(self.engine.model, MultimodalModel):
            if data is not None:
                raise ValueError(f"expected a text-only prompt for {type(self.engine.model).__name__}, got images")
            return token_ids, None
        model = self.engine.model
        if data is None:
            return token_ids, model.multimodal_data(token_ids, None, None)
        if not isinstance(data, dict) or not data:
            raise ValueError(f"expected multi_modal_data as a dict, got {data!r}")
        if set(data) == {"image"}:
            pixel_values, grid_thw = self._process_images(data["image"])
            token_ids = model.expand_placeholders(token_ids, grid_thw)
        elif set(data) == {"pixel_values", "image_grid_thw"}:
            pixel_values, grid_thw = data["pixel_values"], data["image_grid_thw"]
        else:
            raise ValueError(
                "expected multi_modal_data keys {'pixel_values', 'image_grid_thw'} or {'image'}, "
                f"got {sorted(data)}"
            )
        return token_ids, model.multimodal_data(token_ids, pixel_values, grid_thw)

    def _process_images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw images (PIL or arrays) -> ``(pixel_values, image_grid_thw)`` by the checkpoint's processor."""
        try:
            import PIL  # noqa: F401  (the Qwen-VL image processors need it without torchvision)
        except ImportError as err:
            raise ImportError("raw images in multi_modal_data need pillow: pip install pillow") from err
        if self._image_processor is None:
            if not (Path(self.config.model) / "preprocessor_config.json").is_file():
                raise ValueError(
                    "expected preprocessor_config.json in the checkpoint directory to process raw images, got none; "
                    "pass 'pixel_values' and 'image_grid_thw' instead"
                )
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(self.config.model)
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        out = self._image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

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
