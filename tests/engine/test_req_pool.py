"""The request pool's page writes: token slots of whole pages, and on a GPU no wait for the device (a
write alone, and the scheduling of a step ahead under async scheduling)."""

from __future__ import annotations

import pytest
import torch

from portattn.engine.req_pool import ReqToTokenPool
from tiny_models import ENGINE_DEVICE


def test_write_pages_points_pages_at_their_slots():
    pool = ReqToTokenPool(3, 48, 16, ENGINE_DEVICE)
    pool.write_pages(1, 1, [4, 0])  # logical pages 1 and 2 of row 1
    pool.write_pages(1, 0, [])
    table = pool.req_to_token.cpu()
    assert table[1, 16:32].tolist() == list(range(64, 80)) and table[1, 32:48].tolist() == list(range(16))
    assert not table[1, :16].any() and not table[0].any() and not table[2].any()


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_every_step_page_table_has_a_row_stride_of_whole_table_pages(page_size):
    """A step's page table is as wide as its longest sequence needs rounded up to TABLE_PAGES pages, at
    most a whole row of ``req_to_token``: with rows of a multiple of TABLE_PAGES pages its row stride is
    always one Triton specializes, whatever ``max_model_len`` is."""
    from types import SimpleNamespace

    from portattn.backends.base import TABLE_PAGES
    from portattn.backends.torch_ref import TorchBackend

    max_context = -(-913 // page_size) * page_size  # 913, 915 and 928 tokens: 913, 305 and 58 pages
    pool = ReqToTokenPool(2, max_context, page_size, "cpu")
    assert pool.max_context >= max_context and pool.max_context % (TABLE_PAGES * page_size) == 0
    strides = set()
    for longest in (1, page_size * (TABLE_PAGES - 1) + 1, max_context - page_size, max_context):
        batch = SimpleNamespace(
            req_to_token=pool.req_to_token, req_pool_indices=torch.tensor([0]), page_size=page_size,
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seq_lens_k=torch.tensor([longest], dtype=torch.int32),
            out_cache_loc=torch.tensor([0]), max_seqlen_k=longest, attention_chunk_size=None,
        )  # fmt: skip
        table = TorchBackend().plan(batch).page_table
        assert table.shape[1] * page_size >= longest
        strides.add(table.stride(0))
    assert all(stride % TABLE_PAGES == 0 for stride in strides), strides


@pytest.mark.skipif(ENGINE_DEVICE != "cuda", reason="CUDA sync debug mode (PORTATTN_TEST_ENGINE_DEVICE=cuda)")
def test_write_pages_does_not_synchronize_with_the_device():
    """A step launched ahead (async scheduling) is still running while the next step's pages are
    written: the write must be queued, not wait for it (torch's sync debug mode raises on a wait)."""
    pool = ReqToTokenPool(2, 64, 16, "cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the stream busy while the pages are written
        busy = busy @ busy.T / 64
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.write_pages(0, 2, [7, 1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pool.req_to_token[0, 32:64].tolist() == list(range(112, 128)) + list(range(16, 32))


@pytest.mark.skipif(ENGINE_DEVICE != "cuda", reason="CUDA sync debug mode (PORTATTN_TEST_ENGINE_DEVICE=cuda)")
def test_a_step_ahead_is_prepared_without_waiting_for_the_device(ckpt_root, monkeypatch):
    """Under async scheduling the step after a launched one is scheduled (its pages reserved and
    written) while the launched one runs: nothing there may wait for the device. Prompts cross pages
    of 16 on the way."""
    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams
    from portattn.engine.scheduler import Scheduler
    from tiny_models import checkpoint, random_prompts

    llm = LLM(checkpoint("llama", ckpt_root), device="cuda", dtype="bfloat16", page_size=16, num_pages=64,
              max_model_len=256, max_num_seqs=4, async_scheduling=True)  # fmt: skip
    real, calls = Scheduler.schedule_ahead, []

    def ahead(self, in_flight):
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls.append(real(self, in_flight))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return calls[-1]

    monkeypatch.setattr(Scheduler, "schedule_ahead", ahead)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate(random_prompts([5, 14, 30], seed=3), params, use_tqdm=False)
    assert sum(c is not None for c in calls) > 20  # the steps ran ahead, across page boundaries
