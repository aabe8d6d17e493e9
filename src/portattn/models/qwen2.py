"""Qwen2 (``Qwen2ForCausalLM``): Llama's layout with biases on the q, k and v projections (not on o).

Sliding-window layers (``layer_types`` = ``sliding_attention``) get ``window_left = sliding_window - 1``.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
