"""Mistral (``MistralForCausalLM``): Llama's layout with a sliding window on every layer.

``sliding_window = S`` (when set) gives every layer ``window_left = S - 1``; ``None`` is full attention.
"""

from __future__ import annotations

from ..distributed.group import TPGroup
from ..errors import expect
from .layers import SelfAttention, attention_spec
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config, *, tp: TPGroup | None = None):
        window = getattr(config, "sliding_window", None)
        expect(window is None or (isinstance(window, int) and window >= 1), "sliding_window None or >= 1", window)
        super().__init__(config, tp=tp)

    def make_attention(self, config, layer_id: int) -> SelfAttention:
        window = config.sliding_window
        spec = attention_spec(config, layer_id, window_left=-1 if window is None else window - 1)
        return SelfAttention(config.hidden_size, spec, tp=self.tp)
