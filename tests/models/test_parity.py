"""Greedy tokens and logits of the engine equal transformers' own, for every registered family
(``tiny_models.PARITY_FAMILIES``), at page sizes 1, 7 and 16, with and without prefix caching and
chunked prefill (the matrix of :mod:`.family_parity`). Family-specific checks live in each family's
``test_<family>.py``.

The prompts' lengths are 1, short, just below the Llama 4 chunk (32) and past it: decodes cross the
chunk boundary."""

from __future__ import annotations

import pytest

from tiny_models import PARITY_FAMILIES, checkpoint

from .family_parity import assert_matches_transformers


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked8"])
@pytest.mark.parametrize("prefix", [False, True], ids=["noprefix", "prefix"])
@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_matches_transformers(family, page_size, prefix, chunked, ckpt_root):
    assert_matches_transformers(checkpoint(family, ckpt_root), page_size, prefix, chunked)
