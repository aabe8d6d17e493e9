"""The request pool's page writes: token slots of whole pages, and on a GPU no wait for the device."""

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
