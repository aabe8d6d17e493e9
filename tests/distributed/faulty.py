"""A Llama whose rank 1 fails in its second forward, as the checkpoint's config says
(``portattn_test_fault``: ``"raise"``, ``"exit"`` or ``"hang"``); for the fault tests."""

from __future__ import annotations

import os
import time

from portattn.models.llama import LlamaForCausalLM

ARCHITECTURE = "FaultyLlamaForCausalLM"
TARGET = "distributed.faulty:FaultyLlamaForCausalLM"


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
