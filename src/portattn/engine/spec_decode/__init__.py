"""Speculative decoding: proposals (prompt lookup or a draft model), verified by one target forward of
``k + 1`` tokens per sequence with rejection sampling that keeps the target's distribution exactly.

- ``config.py``: ``SpeculativeConfig``, the ``speculative_config`` of ``LLM`` and ``--speculative-config``.
- ``ngram.py``: prompt lookup over the prompt and the generated tokens (vectorised).
- ``draft_model.py``: a draft checkpoint run by the engine's machinery (its own KV pool, rows, graphs).
- ``rejection.py``: verification (greedy, point-mass and draft-distribution proposals) and draft sampling.
- ``speculator.py``: the engine's hooks (scheduling lookahead, proposing, accepting, counters).
"""
