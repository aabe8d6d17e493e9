"""Gemma 3's text model (``Gemma3ForCausalLM``): Gemma 2's layout (:mod:`.gemma2`) with

* ``(1 + w)`` RMSNorm over each query and key head before the rotary embedding;
* ``sliding_window_pattern - 1`` local layers (``sliding_window`` tokens: 512 or 1024 in the released
  models) per global one, as ``layer_types`` lists them;
* rotary embeddings per layer type (``rope_parameters["sliding_attention"]`` and
  ``["full_attention"]``: different bases, linear scaling on the global layers of the larger models);
* no attention softcap (transformers' Gemma 3 attention does not apply ``attn_logit_softcapping``,
  and neither does this); ``final_logit_softcapping`` when set.
"""

from __future__ import annotations

from .gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    attention_softcap = False
