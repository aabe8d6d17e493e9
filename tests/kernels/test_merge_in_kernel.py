"""Split launches whose last split program merges the splits itself (``TileConfig.merge_in_kernel``)
against the same launch with the merge kernel and against the float64 reference: decodes and query
runs, 2-5 splits, sinks, the LSE output, NaN-poisoned slots; the ticket counters are back at zero
after every launch. (Under the interpreter programs run one after another; the GPU suite runs the
concurrent case.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.testing import make_paged_case, max_error, paged_attention_ref

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton import launch
    from portattn.kernels.triton.launch import TileConfig, attention_forward


def run(case, tiles, splits, sinks=None, with_lse=False):
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), device=case.q.device) if with_lse else None
    max_seqlen_q = int((case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).max())
    attention_forward(
        case.q, case.k_cache, case.v_cache, out, case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=max_seqlen_q,
        scale=0.125, page_table=case.page_table, num_kv_splits=splits, tiles=tiles, sinks=sinks, lse=lse,
    )  # fmt: skip
    return out, lse


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "query_run"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_in_kernel_merge_equals_the_merge_kernel(splits, decode, with_sinks):
    k_lens = [1, 15, 16, 17, 70, 0]
    q_lens = [1] * len(k_lens) if decode else [1, 3, 5, 2, 9, 2]
    case = make_paged_case(q_lens, k_lens, page_size=7, dtype=torch.float32, device=DEVICE, seed=splits)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE) if with_sinks else None
    plain = TileConfig(block_q=8, block_m=16, block_n=16, num_warps=4, num_stages=2)
    # the in-kernel merge first: its partial buffers cannot hold the merge kernel's launch's results
    got, got_lse = run(case, dataclasses.replace(plain, merge_in_kernel=True), splits, sinks, with_lse=True)
    want, want_lse = run(case, plain, splits, sinks, with_lse=True)
    assert not got.isnan().any() and not got_lse.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    ref = paged_attention_ref(**case.inputs(), scale=0.125, sinks=sinks)
    assert max_error(got, ref) < 1e-4
    assert int(launch.merge_counters(case.q.device, 1).abs().sum()) == 0  # every ticket put back


def test_in_kernel_merge_in_the_query_dtype():
    case = make_paged_case([1, 1, 1], [40, 3, 64], page_size=16, dtype=torch.float16, device=DEVICE, seed=9)
    plain = TileConfig(block_q=8, block_m=16, block_n=16, num_warps=4, num_stages=2)
    got, _ = run(case, dataclasses.replace(plain, merge_in_kernel=True), 4)
    want, _ = run(case, plain, 4)
    assert got.dtype == torch.float16 and torch.equal(got, want)


def test_the_launch_switches_reach_launches_with_default_tiles(monkeypatch):
    """``benchmarks/engine.py --kernel-options`` sets these module switches: a launch with the default
    tiles then merges in the kernel (the merge kernel must not run) and gives the same output."""
    case = make_paged_case([1, 1], [70, 33], page_size=7, dtype=torch.float32, device=DEVICE, seed=4)
    want, _ = run(case, None, 3)
    monkeypatch.setattr(launch, "MERGE_SPLITS_IN_KERNEL", True)
    monkeypatch.setattr(launch, "PAGES_AHEAD", True)

    class NoMergeKernel:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel ran")

    monkeypatch.setattr(launch, "merge_splits_kernel", NoMergeKernel())
    got, _ = run(case, None, 3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="concurrency: programs run one at a time under the interpreter")
def test_in_kernel_merge_under_load_and_in_a_graph():
    """Many programs racing for their tickets (64 sequences of 1,500 keys, 8 KV heads, 16 splits), launch
    after launch and replayed from a CUDA graph: every output equals the merge kernel's."""
    case = make_paged_case([1] * 64, [1500] * 64, page_size=16, num_q_heads=32, num_kv_heads=8, head_dim=128,
                           dtype=torch.bfloat16, device=DEVICE, seed=1)  # fmt: skip
    want, _ = run(case, None, 16)
    tiles = dataclasses.replace(launch.choose_tiles(1, 4, 128, 128, interpret=False), merge_in_kernel=True)
    for _ in range(20):
        got, _ = run(case, tiles, 16)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
    out = torch.empty_like(case.q)
    call = dict(max_seqlen_q=1, scale=0.125, page_table=case.page_table, num_kv_splits=16, tiles=tiles)
    args = (case.q, case.k_cache, case.v_cache, out, case.cu_seqlens_q, case.seq_lens_k)
    attention_forward(*args, **call)  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_forward(*args, **call)
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, want, rtol=0, atol=1e-2)
    assert int(launch.merge_counters(case.q.device, 1).abs().sum()) == 0
