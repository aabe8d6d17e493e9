"""Chat messages -> what a chat template renders, and the images they carry.

A message is ``{"role": str, "content": str | [part, ...] | None}`` (other keys, such as ``name``,
reach the template as they are). Parts are OpenAI's: ``{"type": "text", "text": str}`` and
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, or Hugging Face's
``{"type": "image", "image": <PIL image or array>}``. A message of text parts reaches the template as
one string (parts joined by newlines), so templates written for string content work; a message
with images keeps its parts, images as ``{"type": "image"}``, as multimodal templates expect.
"""

from __future__ import annotations

import base64
import binascii
import io

# Arguments that apply_chat_template takes itself: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_messages(messages, *, takes_images: bool, model_name: str) -> tuple[list[dict], list]:
    """``(messages for the template, images in order)``; bad messages raise ``ValueError`` naming
    the message and part (``messages[1].content[0]``). ``takes_images``: whether the model reads
    images; a text-only model refuses image parts by ``model_name``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"expected messages as a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    images: list = []
    out = [_message(i, m, images, takes_images, model_name) for i, m in enumerate(messages)]
    return out, images


def check_template_kwargs(kwargs) -> dict:
    """A request's extra template variables (Qwen3's ``enable_thinking``, say), checked."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"expected chat_template_kwargs as a dict with str keys, got {kwargs!r}")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"expected chat_template_kwargs without arguments of apply_chat_template, got {reserved}")
    return dict(kwargs)


def _message(i: int, message, images: list, takes_images: bool, model_name: str) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
        raise ValueError(f"expected messages[{i}] to be a dict with 'role' (str) and 'content', got {message!r}")
    content = message["content"]
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError(f"expected messages[{i}].content to be a str or a list of parts, got {content!r}")
    parts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "image"):
            if not takes_images:
                raise ValueError(f"expected text parts only: {model_name} takes no images, got an image at {where}")
            images.append(_image(part, where))
            parts.append({"type": "image"})
        else:
            raise ValueError(
                f"expected {where} to be a text part {{'type': 'text', 'text': str}} or an image part "
                f"{{'type': 'image_url', 'image_url': {{'url': 'data:image/...;base64,...'}}}}, got {_short(part)}"
            )
    if all(part["type"] == "text" for part in parts):
        return {**message, "content": "\n".join(part["text"] for part in parts)}
    return {**message, "content": parts}


def _image(part: dict, where: str):
    if part["type"] == "image":
        if "image" not in part:
            raise ValueError(f"expected {where} to hold the image under 'image', got keys {sorted(part)}")
        return part["image"]
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise ValueError(f"expected {where}.image_url to be {{'url': str}}, got {_short(spec)}")
    return decode_data_url(url, f"{where}.image_url.url")


def decode_data_url(url: str, where: str = "the image URL"):
    """A ``data:image/...;base64,...`` URL -> an RGB PIL image. Only data URLs: nothing is fetched."""
    head, comma, data = url.partition(",")
    if not (head.startswith("data:") and head.endswith(";base64") and comma):
        raise ValueError(f"expected {where} to be a base64 data URL ('data:image/png;base64,...'), got {_short(url)}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"expected {where} to hold base64 data, got {err}") from None
    try:
        from PIL import Image
    except ImportError as err:
        raise ImportError("images in chat messages need pillow: pip install pillow") from err
    try:
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        what = f"{type(err).__name__}: {err}"
        raise ValueError(f"expected {where} to hold an image that pillow reads, got {what}") from None


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"
