"""A Llama whose rank 1 fails in its second forward, as the checkpoint's config says
(``portattn_test_fault``: ``"raise"``, ``"exit"`` or ``"hang"``); for the fault tests.
``--register distributed.faulty:register`` registers it (``tests/`` on the import path)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from portattn.models import register_model
from portattn.models.llama import LlamaForCausalLM
from tiny_models import checkpoint

ARCHITECTURE = "FaultyLlamaForCausalLM"
TARGET = "distributed.faulty:FaultyLlamaForCausalLM"


def register() -> None:
    register_model(ARCHITECTURE, TARGET)


def faulty_checkpoint(root: str, tmp_path: Path, fault: str) -> str:
    """A copy of the tiny Llama checkpoint whose rank 1 fails with ``fault``; registers the class
    (rank 0 passes its registrations to the other ranks)."""
    path = tmp_path / f"faulty_{fault}"
    shutil.copytree(checkpoint("llama", root), path)
    config = json.loads((path / "config.json").read_text())
    config |= dict(architectures=[ARCHITECTURE], portattn_test_fault=fault)
    (path / "config.json").write_text(json.dumps(config))
    register()
    return str(path)


class FaultyLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config, *, tp=None):
        super().__init__(config, tp=tp)
        self.fault = config.portattn_test_fault
        self.rank = tp.rank if tp is not None else 0
        self.forwards = 0

    def forward(self, input_ids, positions, ctx):
        self.forwards += 1
        if self.rank == 1 and self.forwards == 2:
            if self.fault == "raise":
                raise RuntimeError("injected fault on rank 1")
            if self.fault == "exit":
                os._exit(3)
            if self.fault == "hang":
                time.sleep(3600)
        return super().forward(input_ids, positions, ctx)
