"""The project's own files: the license pyproject declares, the changelog, the typing marker, and a
demo that installs only what it needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_file_is_the_one_pyproject_names():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 201  # the full text


def test_changelog_and_typing_marker():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog") and f"## [{PYPROJECT['project']['version']}]" in changelog
    assert (ROOT / "src" / "portattn" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["portattn"]


def test_make_demo_installs_the_demo_extra_and_test_the_dev_tools():
    makefile = (ROOT / "Makefile").read_text()
    rules = dict(re.findall(r"^(\S+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M))
    assert '-e ".[demo]"' in rules["$(BIN)/portattn"] and "dev" not in rules["$(BIN)/portattn"]
    assert re.search(r"^demo: \$\(BIN\)/portattn$", makefile, re.M)
    assert re.search(r"^test: \$\(VENV\)/\.dev$", makefile, re.M) and '".[dev,bench]"' in rules["$(VENV)/.dev"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    dev_tools = {"pytest", "pytest-xdist", "hypothesis", "ruff"}
    assert not {re.split(r"[<>=\[ ]", req)[0] for req in extras["demo"]} & dev_tools


def test_the_readme_first_example_runs_verbatim():
    """The README's first example (the real model answering a chat question) as printed there."""
    from portattn.testing import smollm2_or_skip

    smollm2_or_skip()
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "smollm2_gguf" in b)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"][0].outputs[0].text == "The capital of France is Paris."
    assert namespace["llm"].config.enable_prefix_caching
