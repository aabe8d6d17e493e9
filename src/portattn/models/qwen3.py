"""Qwen3 (``Qwen3ForCausalLM``): Llama's layout with RMSNorm on each query and key head.

Sliding-window layers (``layer_types`` = ``sliding_attention``) get ``window_left = sliding_window - 1``.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
