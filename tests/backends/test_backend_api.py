"""The engine-facing backend methods: ``plan(batch)`` builds the page table from ``req_to_token``,
``forward`` writes the new K/V to their slots and attends with the layer's masks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from portattn.backends.base import AttentionSpec, Request
from portattn.backends.cache import PagedKVCache
from portattn.backends.registry import select_backend
from portattn.testing import paged_attention_ref
from tiny_models import rel_err


def make_batch(page_size: int, q_lens: list[int], k_lens: list[int], num_pages: int, seed: int = 0):
    """req_to_token rows over a random permutation of pages; the new tokens' slots are out_cache_loc."""
    g = torch.Generator().manual_seed(seed)
    max_context = -(-24 // page_size) * page_size
    req_to_token = torch.full((len(q_lens) + 2, max_context), -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).tolist()
    rows, locs = [3, 0, 2][: len(q_lens)], []
    for row, n, length in zip(rows, q_lens, k_lens):
        pages = [perm.pop() for _ in range(-(-length // page_size))]
        slots = torch.tensor([pages[j // page_size] * page_size + j % page_size for j in range(length)])
        req_to_token[row, :length] = slots
        locs.append(slots[length - n :])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor(rows),
        cu_seqlens_q=cu,
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32),
        out_cache_loc=torch.cat(locs).long(),
        page_size=page_size,
        max_seqlen_k=max(k_lens),
        attention_chunk_size=None,
    )


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layer_kw", [{}, {"window_left": 4}, {"attention_chunk_size": 6}], ids=["full", "w4", "c6"])
def test_plan_and_forward_match_the_reference(page_size, layer_kw):
    q_lens, k_lens = [1, 5, 9], [13, 5, 20]
    batch = make_batch(page_size, q_lens, k_lens, num_pages=-(-64 // page_size))
    spec = AttentionSpec(0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, **layer_kw)
    backend = select_backend("attention", "torch", Request("paged_attention", "cpu", torch.float32, 16))
    num_pages = -(-64 // page_size)
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(num_pages, page_size, 2, 16, generator=g)
    v_cache = torch.randn(num_pages, page_size, 2, 16, generator=g)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    owned[batch.req_to_token[batch.req_to_token >= 0].long()] = True
    k_cache.view(-1, 2, 16)[~owned] = float("nan")  # a read of a slot no sequence owns shows as NaN
    v_cache.view(-1, 2, 16)[~owned] = float("nan")
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    k = torch.randn(sum(q_lens), 2, 16, generator=g)
    v = torch.randn(sum(q_lens), 2, 16, generator=g)

    metadata = backend.plan(batch)
    out = backend.forward(q, k, v, spec, metadata, PagedKVCache(k_cache, v_cache))

    assert torch.equal(k_cache.view(-1, 2, 16)[batch.out_cache_loc], k)
    assert torch.equal(v_cache.view(-1, 2, 16)[batch.out_cache_loc], v)
    for b, row in enumerate(batch.req_pool_indices.tolist()):  # page table: slot // P of each page's first token
        first_slots = batch.req_to_token[row, : k_lens[b] : page_size]
        assert metadata.page_table[b, : first_slots.shape[0]].tolist() == (first_slots // page_size).tolist()
    ref = paged_attention_ref(
        q.double(),
        k_cache.double(),
        v_cache.double(),
        metadata.page_table,
        batch.cu_seqlens_q,
        batch.seq_lens_k,
        scale=0.25,
        causal=True,
        **layer_kw,
    )
    assert rel_err(out.double(), ref) < 1e-5


def test_layer_spec_validates():
    with pytest.raises(ValueError, match="expected num_heads divisible"):
        AttentionSpec(0, num_heads=3, num_kv_heads=2, head_dim=16, scale=0.25)
    with pytest.raises(ValueError, match="expected window_left"):
        AttentionSpec(0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, window_left=-2)
    assert AttentionSpec(0, 4, 2, 16, 0.25, attention_chunk_size=8).features == frozenset({"chunk"})


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_step_page_tables_are_a_multiple_of_16_pages_wide_within_req_to_token(backend_name):
    """Kernels specialize on the table's row stride being divisible by 16: a width that followed each step's
    longest sequence would compile a second variant of each while serving. Capped at req_to_token's width."""
    from portattn.backends.base import TABLE_PAGES
    from portattn.backends.registry import available_backends

    if backend_name not in available_backends("cpu"):
        pytest.skip(f"{backend_name} not available here")
    backend = select_backend("attention", backend_name, Request("paged_attention", "cpu", torch.float32, 16))
    for page_size, max_context, want in ((1, 64, 32), (2, 64, 16), (3, 24, 8), (16, 512, 16)):
        batch = make_batch(page_size, [1, 5, 9], [13, 5, 20], num_pages=-(-64 // page_size))
        wide = torch.full((batch.req_to_token.shape[0], max_context), -1, dtype=torch.int32)
        wide[:, : batch.req_to_token.shape[1]] = batch.req_to_token
        batch.req_to_token = wide
        table = backend.plan(batch).page_table
        assert table.shape == (3, want), (page_size, table.shape)
        assert want % TABLE_PAGES == 0 or want * page_size == max_context
