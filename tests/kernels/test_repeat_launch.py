"""Launches repeated from a plan's memo (``attention_forward(memo=)``, ``fast_launch.RepeatLaunch``):
the next layer's launch of the same geometry reuses what the first computed, and gives what a fresh
launch gives; any difference in geometry, parameters or the plan's tensors takes a fresh launch."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.testing import make_paged_case, max_error, paged_attention_ref

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    import triton
    import triton.language as tl

    from portattn.kernels.triton import fast_launch
    from portattn.kernels.triton.launch import attention_forward

    @triton.jit
    def scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


def attend(case, q, k, v, splits, memo=None, sinks=None, lse=None, page_table=None):
    out = torch.full_like(q, float("nan"))
    max_seqlen_q = int((case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).max())
    attention_forward(
        q, k, v, out, case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=max_seqlen_q, scale=0.125,
        page_table=case.page_table if page_table is None else page_table, num_kv_splits=splits, sinks=sinks,
        lse=lse, max_seqlen_k=int(case.seq_lens_k.max()), memo=memo,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "query_run"])
def test_layers_of_one_plan_share_a_launch_and_match_fresh_launches(splits, decode):
    k_lens = [1, 15, 16, 17, 40]
    q_lens = [1] * len(k_lens) if decode else [1, 3, 5, 2, 9]
    case = make_paged_case(q_lens, k_lens, page_size=7, dtype=torch.float16, device=DEVICE, seed=splits)
    memo = {}
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    for layer in range(3):  # each layer: its own queries and cache, the plan's lengths and table
        gen = torch.Generator(device="cpu").manual_seed(layer)
        q, k, v = (torch.randn(t.shape, generator=gen).to(case.q) for t in (case.q, case.k_cache, case.v_cache))
        for layer_sinks in (None, sinks):
            got = attend(case, q, k, v, splits, memo, layer_sinks)
            assert torch.equal(got, attend(case, q, k, v, splits, sinks=layer_sinks))
            inputs = case.inputs() | {"q": q, "k_cache": k, "v_cache": v}
            assert max_error(got, paged_attention_ref(**inputs, scale=0.125, sinks=layer_sinks)) < 2e-3
    assert len(memo) == 2  # one launch with sinks, one without, for every layer


def test_another_table_or_query_geometry_takes_a_fresh_launch():
    case = make_paged_case([1, 1, 1], [40, 3, 64], page_size=16, dtype=torch.float16, device=DEVICE, seed=9)
    memo = {}
    attend(case, case.q, case.k_cache, case.v_cache, 1, memo)
    # the same keys moved to other pages, with the table that says so: a memo keyed on shapes alone would
    # read the old table (over the new cache: other keys)
    perm = torch.randperm(case.k_cache.shape[0], generator=torch.Generator().manual_seed(0)).to(DEVICE)
    table = perm[case.page_table.long()].to(torch.int32)
    k, v = torch.empty_like(case.k_cache), torch.empty_like(case.v_cache)
    k[perm], v[perm] = case.k_cache, case.v_cache
    got = attend(case, case.q, k, v, 1, memo, page_table=table)
    assert torch.equal(got, attend(case, case.q, case.k_cache, case.v_cache, 1))
    wide = case.q.repeat(1, 2, 1)  # twice the query heads
    got = torch.full_like(wide, float("nan"))
    attention_forward(wide, case.k_cache, case.v_cache, got, case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=1,
                      scale=0.125, page_table=case.page_table, memo=memo)  # fmt: skip
    assert not got.isnan().any()
    assert len(memo) == 3


def test_a_repeated_launch_takes_new_tensors_and_falls_back_on_another_alignment():
    """A RepeatLaunch writes where its new tensors say; a tensor at an address Triton specializes
    differently (not divisible by 16) goes through Triton (the kept kernel assumed alignment)."""
    x = torch.arange(40, dtype=torch.float32, device=DEVICE)
    y = torch.zeros(40, dtype=torch.float32, device=DEVICE)
    launch = fast_launch.RepeatLaunch(scale_kernel, (3,), (x, y, 40, 2.0), {"BLOCK": 16})
    assert torch.equal(y, 2 * x)
    if torch.device(DEVICE).type == "cuda":
        assert launch.runner is not None  # the compiled kernel is kept where Triton compiles one
    x2, y2 = x + 1, torch.zeros(40, dtype=torch.float32, device=DEVICE)
    launch.again((x2, y2, 40, 2.0))
    assert torch.equal(y2, 2 * x2)
    base = torch.zeros(41, dtype=torch.float32, device=DEVICE)
    shifted = base[1:]  # 4 bytes past an aligned address
    assert fast_launch._signature((x2, shifted, 40, 2.0)) != launch.signature
    launch.again((x2, shifted, 40, 2.0))
    assert torch.equal(shifted, 2 * x2) and base[0] == 0
    assert fast_launch._signature((x, y, 1, 2.0)) != fast_launch._signature((x, y, 40, 2.0))  # 1 is specialized


def test_the_quick_check_of_a_repeated_launch_agrees_with_the_whole_signature():
    """``RepeatLaunch`` decides from the tensors' dtype and alignment and the other arguments' types and
    values where those match, from the whole signature where they do not: both decide alike for tensors
    moved, re-typed or unaligned, integers that Triton specializes alike or not (1, multiples of 16), a
    float where an integer was, a tensor's place taken by something else, and another count of arguments."""
    x = torch.arange(64, dtype=torch.float32, device=DEVICE)
    y = torch.zeros(64, dtype=torch.float32, device=DEVICE)
    launch = fast_launch.RepeatLaunch(scale_kernel, (4,), (x, y, 48, 2.0), {"BLOCK": 16})
    unaligned = torch.zeros(65, dtype=torch.float32, device=DEVICE)[1:]
    cases = {
        "new tensors, same values": ((x + 1, torch.zeros_like(y), 48, 2.0), True),
        "another multiple of 16": ((x, y, 32, 2.0), True),
        "another float": ((x, y, 48, 3.0), True),
        "not a multiple of 16": ((x, y, 40, 2.0), False),
        "one": ((x, y, 1, 2.0), False),
        "unaligned tensor": ((x, unaligned, 48, 2.0), False),
        "another dtype": ((x.half(), y, 48, 2.0), False),
        "a float for the integer": ((x, y, 48.0, 2.0), False),
        "None for a tensor": ((x, None, 48, 2.0), False),
        "fewer arguments": ((x, y, 48), False),
    }
    for name, (args, alike) in cases.items():
        assert launch._specialized_alike(args) is alike, name
        assert (fast_launch._signature(args) == launch.signature) is alike, name
