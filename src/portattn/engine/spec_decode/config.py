"""``speculative_config``: vLLM's keys and methods, validated once (no other key or method is accepted)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from ...errors import expect, fail, is_int

METHODS = ("ngram", "draft_model")
# Both prompt_lookup bounds when neither is given (vLLM's defaults).
DEFAULT_PROMPT_LOOKUP = 5
# Speculation pauses in steps that start with more running sequences than this, unless the config
# says otherwise: SmolLM2-135M on an H200 gained 1.1-1.3x at 8 sequences and lost 10-40% at 16
# (benchmarks/results/spec_decode_h200/), where a step is no longer bound by streaming the weights.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: ``num_speculative_tokens`` (``k``) tokens are proposed per running
    sequence and verified by one forward of ``k + 1`` tokens (docs/speculative_decoding.md).

    ``method``:

    * ``"ngram"``: prompt lookup. The longest suffix of the sequence's tokens (prompt and output) of
      ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens that occurred before proposes the tokens
      that followed its earliest occurrence. Neither bound given: both 5; one given: the other
      equals it.
    * ``"draft_model"`` (the default when ``model`` is given): ``model`` (a checkpoint folder, or a
      GGUF file where the loader reads them) proposes greedily or by sampling, as the request samples;
      it must have the target's vocabulary.

    ``disable_by_batch_size``: no speculation in a step that starts with more running sequences
    than this (logged when it turns off and on again); default ``DEFAULT_DISABLE_BY_BATCH_SIZE`` (8),
    ``None``: always speculate.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        expect(is_int(k) and k >= 1, "num_speculative_tokens to be an int >= 1", repr(k))
        expect(self.method in METHODS, f"speculative_config method among {list(METHODS)}", repr(self.method))
        if self.method == "draft_model":
            ok = isinstance(self.model, (str, os.PathLike)) and os.fspath(self.model) != ""
            expect(ok, "speculative_config model (a draft checkpoint) for method 'draft_model'", repr(self.model))
            object.__setattr__(self, "model", os.fspath(self.model))
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    fail(f"{name} only with method 'ngram'", f"{name}={getattr(self, name)!r} for 'draft_model'")
        else:
            expect(self.model is None, "no speculative_config model for method 'ngram'", repr(self.model))
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                expect(value is None or (is_int(value) and value >= 1), f"{name} to be an int >= 1", repr(value))
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            expect(lo <= hi, f"prompt_lookup_min <= prompt_lookup_max {hi}", lo)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        size = self.disable_by_batch_size
        expect(size is None or (is_int(size) and size >= 1), "disable_by_batch_size to be an int >= 1", repr(size))

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
        """From a JSON object (``--speculative-config``), a dict of vLLM's keys, or a config. An unknown key
        or method raises ``ValueError`` naming it; ``method`` defaults to ``"draft_model"`` when
        ``model`` is given (as in vLLM)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                fail("speculative_config to be a JSON object", f"{value!r} ({err})")
        expect(isinstance(value, dict), "speculative_config to be a dict (or a JSON object)", repr(value))
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known), key=str)
        expect(not unknown, f"speculative_config keys among {known}", f"unknown {unknown}")
        expect("num_speculative_tokens" in value, "speculative_config num_speculative_tokens", "none")
        fields = dict(value)
        if "method" not in fields:
            what = "speculative_config method ('ngram') or model (a draft checkpoint)"
            expect(fields.get("model") is not None, what, "neither")
            fields["method"] = "draft_model"
        return cls(**fields)

    def as_dict(self) -> dict:
        """The keys that are set, as ``parse`` takes them (``disable_by_batch_size`` also when ``None``)."""
        keep = ("disable_by_batch_size",)
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k in keep}
