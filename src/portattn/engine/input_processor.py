"""Prompts -> token ids (+ images): plain text, token ids, dicts with images, and chat messages
through the checkpoint's chat template. Shared by :class:`portattn.LLM` and the HTTP server."""

from __future__ import annotations

import torch

from ..errors import all_ints, is_int
from ..models import loader
from ..models.base import MultimodalModel
from ..runtime.multimodal import MultimodalData
from ..validation import check_pixel_values
from .chat import check_template_kwargs, template_messages


class InputProcessor:
    """Turns prompts into ``(token ids, images)`` for one loaded model.

    ``tokenizer`` may be ``None`` (a directory without one): then only token-id prompts work.
    """

    def __init__(self, model, tokenizer, model_dir: str):
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self._image_processor = None  # loaded on the first raw image
        self._token_texts: dict[int, str] = {}

    # -- text --------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text`` -> token ids; ``add_special_tokens`` adds what the tokenizer adds (a BOS, say)."""
        if self.tokenizer is None:
            raise ValueError("expected token-id prompts: the model directory has no tokenizer, got a str")
        try:  # the tokenizer would raise a TypeError that names no character
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            got = f"a lone surrogate {text[err.start]!r} at character {err.start}"
            raise ValueError(f"expected text that UTF-8 can encode, got {got}") from None
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included), as log-probabilities name it."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
            self._token_texts[token_id] = text
        return text

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None) is not None

    def chat(
        self,
        messages: list[dict],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> tuple[str, list[int], list]:
        """One conversation -> ``(rendered text, token ids, images)`` through the chat template.

        ``messages`` are ``{"role": str, "content": str | [part, ...]}`` with text and image parts
        (:mod:`portattn.engine.chat`); images (multimodal models only) come back in order, their
        placeholders in the text, for :meth:`process`'s ``{"image": images}``. The rendered text is
        tokenized without adding special tokens: the template writes its own (a BOS, say), so none
        is doubled. ``chat_template`` overrides the checkpoint's template; ``chat_template_kwargs``
        are extra template variables. Template errors (``jinja2.TemplateError``, including a
        template's ``raise_exception``) propagate as they are.
        """
        if self.tokenizer is None:
            raise ValueError("expected a model directory with a tokenizer for chat, got none")
        if chat_template is None and not self.has_chat_template:
            raise ValueError(
                f"expected a chat template in the tokenizer of {self.model_dir!r} (tokenizer_config.json "
                "'chat_template' or chat_template.jinja), got none; pass chat_template= or use generate()"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError("expected add_generation_prompt=False with continue_final_message=True, got both True")
        kwargs = check_template_kwargs(chat_template_kwargs)
        takes_images = isinstance(self.model, MultimodalModel)
        messages, images = template_messages(messages, takes_images=takes_images, model_name=type(self.model).__name__)
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
        return text, self.tokenize(text, add_special_tokens=False), images

    # -- prompts -----------------------------------------------------------------------------

    def process(self, prompt) -> tuple[list[int], MultimodalData | None]:
        """``(token ids, images)`` of one prompt: a str, a list of ids, or a dict with
        ``"prompt"`` or ``"prompt_token_ids"`` and optionally ``"multi_modal_data"``."""
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
            token_ids = self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            # NumPy ints become ints; anything else is refused, naming it, by the engine's prompt check.
            token_ids = list(prompt) if all_ints(prompt) else [int(t) if is_int(t) else t for t in prompt]
        elif hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):
            token_ids = _array_ids(prompt)
        else:
            raise ValueError(
                f"expected a prompt as str, list[int], a 1-D integer array or dict, got {type(prompt).__name__}"
            )
        if not isinstance(self.model, MultimodalModel):
            if data is not None:
                raise ValueError(f"expected a text-only prompt for {type(self.model).__name__}, got images")
            return token_ids, None
        model = self.model
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
        check_pixel_values(pixel_values)
        return token_ids, model.multimodal_data(token_ids, pixel_values, grid_thw)

    def _process_images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw images (PIL or arrays) -> ``(pixel_values, image_grid_thw)`` by the checkpoint's processor."""
        try:
            import PIL  # noqa: F401  (the Qwen-VL image processors need it without torchvision)
        except ImportError as err:
            raise ImportError("raw images in multi_modal_data need pillow: pip install pillow") from err
        if self._image_processor is None:
            self._image_processor = loader.load_image_processor(self.model_dir)
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        out = self._image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def _array_ids(array) -> list[int]:
    """A 1-D integer NumPy array or tensor of token ids -> a list of ints."""
    dtype = str(array.dtype).removeprefix("torch.")
    if array.ndim != 1 or not dtype.startswith(("int", "uint")):
        raise ValueError(
            f"expected token ids as a 1-D integer array, got {array.ndim}-D of dtype {dtype} "
            f"(shape {tuple(array.shape)})"
        )
    return array.tolist()
