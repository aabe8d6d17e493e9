"""Output tokens -> text as they are generated, and stop strings matched on that text."""

from __future__ import annotations

import functools
from collections.abc import Callable

from .sampling_params import SamplingParams


def library_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The ``tokenizers`` library's own decode of a transformers fast tokenizer, where it returns exactly
    what ``tokenizer.decode`` does (neither method overridden, no clean-up of spaces): the same text
    without transformers' per-call conversions, which cost more than the decode itself for the few
    tokens of a step. ``None`` for any other tokenizer."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    if (
        not isinstance(tokenizer, PreTrainedTokenizerFast)
        or backend is None
        or cls.decode is not PreTrainedTokenizerFast.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, extended one token at a time.

    ``text`` always equals ``tokenizer.decode(tokens, skip_special_tokens=...)`` of the tokens given
    so far, cut at a stop string: each step decodes only a short window (the tokens since the last
    complete character, after a few tokens of context), and takes the part of the window's text past
    the context. A window whose text ends in an incomplete UTF-8 sequence (the replacement character)
    waits for the next token.

    Without stop strings nothing needs the text token by token, so :meth:`append` only records the
    token and the text catches up when it is read (``text``, :meth:`streamable`, :meth:`flush`): a
    stream reads it every step and decodes as before; ``LLM.generate`` reads it once, at the end, and
    decodes each sequence's output in two calls instead of two per token (on a 2-core CPU, 64
    sequences: about 4 us a token less in every engine step, ``benchmarks/host_path.py``).

    Streaming: :meth:`streamable` holds back the last ``len(longest stop string) - 1`` characters
    while the sequence runs, so that a stop string that is still forming is never sent and then
    retracted; joined deltas equal the final ``text``.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self._library_decode = library_decode(tokenizer, params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        longest = max(map(len, self.stop), default=0)
        self.holdback = 0 if self.include_stop or not longest else longest - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this are in `text`
        self._text = ""
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (cut at a stop string): what ``decode`` gives for the tokens appended, less
        a trailing incomplete character."""
        if self.read_offset < len(self.ids) and not self.stopped:
            self._catch_up()
        return self._text

    def _decode(self, ids: list[int]) -> str:
        if self._library_decode is not None:
            return self._library_decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> int:
        """Add one token; returns how many characters ``text`` grew by (0 without stop strings: the
        text catches up when read)."""
        self.ids.append(token_id)
        return self._catch_up() if self.stop else 0

    def _catch_up(self) -> int:
        """Decode the tokens since the last complete character after a few tokens of context, and add
        the part of that window's text past the context; returns how many characters were added."""
        context = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return 0
        delta = window[len(context) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._text += delta
        return len(delta)

    def flush(self) -> None:
        """At the end: add what waited for more bytes (as ``decode`` renders it: replacement characters)."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        context = self._decode(self.ids[self.prefix_offset : self.read_offset])
        self._text += self._decode(self.ids[self.prefix_offset :])[len(context) :]
        self.read_offset = len(self.ids)

    def find_stop(self, num_new_chars: int) -> str | None:
        """The stop string that the last ``num_new_chars`` characters completed (the earliest in the text),
        with ``text`` cut before it (or after it, with ``include_stop_str_in_output``); else None."""
        if not num_new_chars or not self.stop:
            return None
        best = None
        text = self._text  # append decoded it up to date
        for stop in self.stop:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            at = text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self._text = text[: at + len(stop)] if self.include_stop else text[:at]
        self.stopped = True
        return stop

    def streamable(self, finished: bool) -> int:
        """How many characters of ``text`` may be sent to a client now."""
        return len(self.text) if finished else max(0, len(self.text) - self.holdback)
