"""The op library installs with torch alone: ``import portattn`` and the ops run with the engine's and the
server's packages refused, ``import portattn`` imports none of them, and the entry points that need an
extra name it (``pip install 'portattn[engine]'``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from portattn.extras import EXTRAS, INCLUDES, missing_packages, require_extra

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# Everything beyond torch that some part of the project imports (the extras' packages, triton, and
# numpy, which transformers brings and torch does not require).
OPTIONAL = (
    "transformers",
    "safetensors",
    "tqdm",
    "gguf",
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "triton",
    "numpy",
)

REFUSE = textwrap.dedent(
    """
    import importlib.abc, sys
    REFUSED = set(sys.argv[1].split(","))

    class Refuse(importlib.abc.MetaPathFinder):
        # As if the packages were not installed: what a fresh `pip install portattn` has.
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in REFUSED:
                raise ModuleNotFoundError(f"No module named {name!r} (refused)", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    """
)


def run(code: str, refused=()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    script = REFUSE + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, ",".join(refused)], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_ops_import_and_run_without_the_extras():
    done = run(
        """
        import torch
        import portattn
        from portattn.testing import make_paged_case, paged_attention_ref, mla_decode_ref, varlen_attention_ref

        case = make_paged_case([1, 3, 6], [5, 9, 6], page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=16,
                               dtype=torch.float32, seed=0)
        out = portattn.paged_attention(**case.inputs(), window_left=3)
        ref = paged_attention_ref(**case.inputs(), window_left=3)
        assert (out.double() - ref).abs().max() < 1e-5

        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(10, 4, 16, generator=g) for _ in range(3))
        cu = torch.tensor([0, 3, 10], dtype=torch.int32)
        out = portattn.varlen_attention(q, k, v, cu, causal=True)
        assert (out.double() - varlen_attention_ref(q, k, v, cu, causal=True)).abs().max() < 1e-5

        q_nope, q_rope = torch.randn(2, 4, 32, generator=g), torch.randn(2, 4, 8, generator=g)
        kv_cache = torch.randn(4, 4, 40, generator=g)
        table = portattn.PageTable(torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), 4)
        lens = torch.tensor([7, 3], dtype=torch.int32)
        out = portattn.mla_decode(q_nope, q_rope, kv_cache, table, lens, scale=0.2)
        assert (out.double() - mla_decode_ref(q_nope, q_rope, kv_cache, table, lens, scale=0.2)).abs().max() < 1e-5

        for name in ("LLM", "RequestOutput"):
            try:
                getattr(portattn, name)
            except ImportError as exc:
                assert "pip install 'portattn[engine]'" in str(exc) and "transformers" in str(exc), exc
            else:
                raise AssertionError(f"portattn.{name} without the engine extra")
        from portattn.cli import main
        assert main(["generate", "--model", "any", "--prompt", "hi"]) == 2
        print("ok")
        """,
        refused=OPTIONAL,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
    assert "portattn generate: error: ImportError: portattn generate needs the engine extra" in done.stderr


def test_import_portattn_imports_none_of_the_extras():
    """Measured against ``import torch`` alone (torch imports some optional packages itself when present)."""
    done = run(
        """
        import json, sys
        import torch
        before = {m.split(".")[0] for m in sys.modules}
        import portattn
        import portattn.engine, portattn.server  # the packages' own modules are light too
        print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} - before)))
        """
    )
    assert done.returncode == 0, done.stderr
    added = set(json.loads(done.stdout.splitlines()[-1]))
    assert "portattn" in added and not added & set(OPTIONAL), sorted(added & set(OPTIONAL))


def test_require_extra_names_the_extra_and_the_missing_packages(monkeypatch):
    import portattn.extras as extras

    monkeypatch.setattr(extras, "_installed", lambda name: name not in ("uvicorn", "safetensors"))
    assert missing_packages("serve") == ["safetensors", "uvicorn"]  # serve brings the engine's packages too
    with pytest.raises(ImportError, match=r"portattn serve needs the serve extra: pip install 'portattn\[serve\]' "):
        require_extra("serve", "portattn serve")
    with pytest.raises(ValueError, match="expected an extra in"):
        missing_packages("server")


def test_the_extras_match_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [re.split(r"[<>=\[ ;]", req)[0] for req in project["dependencies"]] == ["torch"]
    extras = project["optional-dependencies"]

    def packages(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            name, _, rest = re.split(r"[<>=;]", req)[0].partition("[")
            out |= {p for e in rest.rstrip("]").split(",") if e for p in packages(e)} if name == "portattn" else {name}
        return out

    for extra, modules in EXTRAS.items():
        assert set(modules) <= packages(extra), extra
        for included in INCLUDES.get(extra, ()):
            assert packages(included) <= packages(extra), (extra, included)
    assert packages("engine") <= packages("demo") and packages("serve") <= packages("dev")
