"""The family tables in docs/families.md and the README name exactly the architectures portattn registers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from portattn.models import registered_models

ROOT = Path(__file__).resolve().parents[2]


def architectures_in_table(text: str) -> set[str]:
    """The `...ForCausalLM` / `...ForConditionalGeneration` names in the markdown table rows of ``text``."""
    rows = [line for line in text.splitlines() if line.startswith("| `") or line.startswith("| ")]
    return set(re.findall(r"`(\w+For(?:CausalLM|ConditionalGeneration))`", "\n".join(rows)))


@pytest.mark.parametrize("doc", ["docs/families.md", "README.md"])
def test_the_family_table_is_the_registry(doc):
    named = architectures_in_table((ROOT / doc).read_text())
    # The project's own families (tests register others, e.g. tests/distributed/faulty.py).
    registered = {name for name, target in registered_models().items() if target.startswith("portattn.models.")}
    assert named == registered, (
        f"{doc}: missing {sorted(registered - named)}, not registered {sorted(named - registered)}"
    )
