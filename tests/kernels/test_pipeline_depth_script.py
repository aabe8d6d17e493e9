"""``scripts/pipeline_depth.py`` (the decode kernel compiled for sm_90 without a GPU) still compiles the
kernel as the launcher calls it: every constexpr the launch sets or leaves at its default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


# The script captures the launch under Triton's interpreter first, which Triton 3.6's interpreter cannot
# run through the kernel's page-table arithmetic (scripts/pipeline_depth.py's doc).
@pytest.mark.skipif(_version(triton.__version__) < (3, 9), reason="the launch capture needs Triton 3.9's interpreter")
def test_the_pipeline_depth_script_compiles_a_decode_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(ROOT / "scripts" / "pipeline_depth.py"), "--kv", "bf16", "--block-n", "64",
               "--warps", "4", "--stages", "5"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip("no ptxas for sm_90 here")
    assert done.returncode == 0, done.stderr[-3000:]
    row = re.search(r"^\s+64\s+4\s+5 \|\s+(\d+)\s+(\d+) / (\d+)\s+(wgmma|mma\.sync)", done.stdout, re.M)
    assert row is not None, done.stdout
    assert int(row.group(1)) >= 1 and int(row.group(2)) > 0  # a K buffer and asynchronous copies
