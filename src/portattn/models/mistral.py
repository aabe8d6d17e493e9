"""Mistral (``MistralForCausalLM``): Llama's layout with a sliding window on every layer.

``sliding_window = S`` (when set) gives every layer ``window_left = S - 1``; ``None`` is full attention.
"""

from __future__ import annotations

from ..backends.base import AttentionLayer
from ..distributed.group import TPGroup
from ..errors import expect
from .layers import SelfAttention, head_dim_of
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config, *, tp: TPGroup | None = None):
        window = getattr(config, "sliding_window", None)
        expect(window is None or (isinstance(window, int) and window >= 1), "sliding_window None or >= 1", window)
        super().__init__(config, tp=tp)

    def make_attention(self, config, layer_id: int) -> SelfAttention:
        head_dim = head_dim_of(config)
        window = config.sliding_window
        spec = AttentionLayer(
            layer_id,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            scale=head_dim**-0.5,
            window_left=-1 if window is None else window - 1,
        )
        return SelfAttention(config.hidden_size, spec, tp=self.tp)
