"""ForwardBatch.build (numpy over per-sequence arrays, one staged copy) against a plain loop over tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from portattn.backends.torch_ref import TorchBackend
from portattn.engine.forward_batch import ForwardBatch, Staging
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.sequence import Sequence


def reference(scheduled, req_to_token):
    ids, positions, slots, q_lens, k_lens = [], [], [], [], []
    for seq, n in scheduled:
        for i in range(seq.num_computed, seq.num_computed + n):
            ids.append(seq.token_ids[i])
            positions.append(i)
            slots.append(int(req_to_token[seq.req_pool_idx, i]))
        q_lens.append(n)
        k_lens.append(seq.num_computed + n)
    return ids, positions, slots, q_lens, k_lens


def make_scheduled(shapes, seed=0):
    """``(num_computed, n)`` pairs -> sequences with random tokens in rows 3, 4, ... of req_to_token."""
    g = torch.Generator().manual_seed(seed)
    scheduled = []
    for row, (done, n) in enumerate(shapes, start=3):
        seq = Sequence(row, torch.randint(0, 1000, (done + n,), generator=g).tolist(), SamplingParams())
        seq.num_computed, seq.req_pool_idx = done, row
        scheduled.append((seq, n))
    return scheduled


def test_build_equals_a_loop_over_tokens():
    req_to_token = torch.randperm(16 * 64, dtype=torch.int32).view(16, 64)
    staging = Staging(torch.device("cpu"))
    cases = {
        "mixed": [(0, 7), (12, 1), (5, 9), (30, 1), (0, 1)],
        "decode": [(4, 1), (17, 1), (1, 1)],
        "prefill": [(0, 3), (0, 33)],
        "extend": [(8, 4), (0, 2)],
    }
    for mode, shapes in cases.items():  # one staging buffer reused across steps
        scheduled = make_scheduled(shapes)
        batch = ForwardBatch.build(scheduled, req_to_token, 4, staging=staging)
        ids, positions, slots, q_lens, k_lens = reference(scheduled, req_to_token)
        assert batch.mode == mode
        assert batch.input_ids.tolist() == ids and batch.positions.tolist() == positions
        assert batch.out_cache_loc.tolist() == slots and batch.out_cache_loc.dtype == torch.int64
        assert batch.cu_seqlens_q.tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        assert batch.seq_lens_k.tolist() == k_lens and batch.seq_lens_k.dtype == torch.int32
        assert batch.req_pool_indices.tolist() == [s.req_pool_idx for s, _ in scheduled]
        assert (batch.q_lens, batch.k_lens, batch.max_seqlen_k) == (tuple(q_lens), tuple(k_lens), max(k_lens))


def test_staging_views_start_aligned_whatever_the_sizes():
    """Every uploaded array starts at a multiple of 128 bytes (a kernel given a view is compiled for an
    aligned pointer whatever the step's sizes) and holds the array's values."""
    staging = Staging(torch.device("cpu"))
    for sizes in ([3, 1, 5], [17, 16, 2, 1], [1]):
        arrays = [np.arange(n, dtype=np.int64) * 10 + i for i, n in enumerate(sizes)]
        views = staging.upload(arrays)
        assert [v.tolist() for v in views] == [a.tolist() for a in arrays]
        # offsets of 128 bytes in the buffer (whose base the device allocator aligns: 512 bytes on CUDA)
        assert all((v.data_ptr() - staging.dev.data_ptr()) % 128 == 0 for v in views)


def test_staging_grows_past_its_first_size():
    staging = Staging(torch.device("cpu"))
    big = make_scheduled([(0, 3000), (10, 2000)])
    req_to_token = torch.arange(16 * 5120, dtype=torch.int32).view(16, 5120)
    with torch.inference_mode():  # as in a step; the grown buffers must stay writable outside it
        batch = ForwardBatch.build(big, req_to_token, 16, staging=staging)
    assert batch.input_ids.tolist() == reference(big, req_to_token)[0]
    assert staging.host.shape[0] >= 3 * 5000 + 3 * 2 + 1
    small = make_scheduled([(4, 1), (17, 1)])
    assert (
        ForwardBatch.build(small, req_to_token, 16, staging=staging).input_ids.tolist()
        == reference(small, req_to_token)[0]
    )


def test_plan_from_host_lengths_equals_plan_from_the_device():
    req_to_token = torch.arange(16 * 64, dtype=torch.int32).view(16, 64)
    batch = ForwardBatch.build(make_scheduled([(0, 7), (12, 1), (5, 9)]), req_to_token, 4)
    backend = TorchBackend()
    with_host = backend.plan(batch)
    without = backend.plan_paged(batch.cu_seqlens_q, batch.seq_lens_k, with_host.page_table, 4)
    for name in ("q_lens", "k_lens", "max_seqlen_q", "max_seqlen_k"):
        assert getattr(with_host, name) == getattr(without, name)


def test_fed_sequences_decode_their_token_in_flight():
    """A fed sequence (its next token sampled by a step in flight, not in ``token_ids``) decodes that
    token: position and slot ``num_tokens``, ``num_tokens + 1`` keys, input id 0 until the runner's feed
    replaces it; the others are built from their tokens. A fed sequence scheduled otherwise is refused."""
    req_to_token = torch.randperm(16 * 64, dtype=torch.int32).view(16, 64)
    scheduled = make_scheduled([(5, 9), (12, 1), (30, 1), (0, 3)])
    fed = [scheduled[1][0], scheduled[2][0]]
    for seq in fed:  # the token at num_computed is the one in flight
        seq.token_ids.pop()
    batch = ForwardBatch.build(scheduled, req_to_token, 4, fed=fed)
    for seq in fed:
        seq.token_ids.append(0)  # the placeholder, as the reference reads it
    ids, positions, slots, _, k_lens = reference(scheduled, req_to_token)
    assert batch.input_ids.tolist() == ids and batch.positions.tolist() == positions and ids[9:11] == [0, 0]
    assert batch.out_cache_loc.tolist() == slots and batch.seq_lens_k.tolist() == k_lens == [14, 13, 31, 3]
    assert batch.mode == "mixed"
    with pytest.raises(ValueError, match="expected a fed sequence to decode its token in flight, got 9 tokens"):
        ForwardBatch.build(scheduled, req_to_token, 4, fed=[scheduled[0][0]])
