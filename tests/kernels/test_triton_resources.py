"""Launches that do not fit a device's on-chip memory step down to smaller tiles, with equal results."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import BACKENDS, DEVICE

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton backend not available here")

if "triton" in BACKENDS:
    from triton.runtime.errors import OutOfResources

    from portattn.kernels.triton import launch, mla_decode_launch, resources
    from portattn.kernels.triton.launch import TileConfig, attention_forward
    from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward


@dataclasses.dataclass(frozen=True)
class _Tiles:
    block_n: int
    block_h: int
    num_stages: int


def test_launch_fitting_shrinks_in_order_and_remembers():
    tried = []

    def run(t):
        tried.append(t)
        if t.num_stages > 1 or t.block_n > 16:
            raise OutOfResources(200_000, 65_536, "shared memory")

    first = _Tiles(block_n=64, block_h=32, num_stages=3)
    shrink = lambda t: resources.fewer_stages_then(t, "block_n", "block_h")
    used = resources.launch_fitting(run, first, shrink, key=("test-fit", 1))
    assert used == _Tiles(16, 32, 1)
    assert [(t.num_stages, t.block_n) for t in tried] == [(3, 64), (2, 64), (1, 64), (1, 32), (1, 16)]
    tried.clear()
    assert resources.launch_fitting(run, first, shrink, key=("test-fit", 1)) == used
    assert tried == [used]  # the fitted tiles are used straight away the next time


def test_launch_fitting_raises_when_nothing_fits():
    def run(t):
        raise OutOfResources(1 << 20, 1 << 16, "shared memory")

    shrink = lambda t: resources.fewer_stages_then(t, "block_n")
    with pytest.raises(OutOfResources):
        resources.launch_fitting(run, _Tiles(32, 16, 2), shrink, key=("test-fit", 2))


class _SmallDevice:
    """Wraps a kernel: launches whose constexprs exceed the limits fail as on a device with less memory."""

    def __init__(self, kernel, **limits):
        self.kernel, self.limits, self.seen = kernel, limits, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.seen.append({name: kwargs[name] for name in self.limits})
            if any(kwargs[name] > limit for name, limit in self.limits.items()):
                raise OutOfResources(100_000, 65_536, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return run


def test_attention_launch_fits_smaller_tiles(monkeypatch):
    from portattn.testing import make_paged_case, max_error, paged_attention_ref

    small = _SmallDevice(launch.attention_fwd_kernel, num_stages=1, BLOCK_M=16)
    monkeypatch.setattr(launch, "attention_fwd_kernel", small)
    case = make_paged_case([3, 1], [20, 9], page_size=4, dtype=torch.float32, device=DEVICE, seed=7)
    out = torch.full_like(case.q, float("nan"))
    attention_forward(
        case.q, case.k_cache, case.v_cache, out, case.cu_seqlens_q, case.seq_lens_k,
        max_seqlen_q=3, scale=0.125, page_table=case.page_table,
        tiles=TileConfig(block_q=16, block_m=32, block_n=16, num_warps=4, num_stages=2),
    )  # fmt: skip
    assert small.seen[-1] == {"num_stages": 1, "BLOCK_M": 16} and len(small.seen) == 3
    assert max_error(out, paged_attention_ref(**case.inputs(), scale=0.125)) < 1e-5


def test_mla_launch_fits_smaller_tiles_and_merges_with_them(monkeypatch):
    import portattn
    from portattn.testing import max_error, mla_decode_ref

    small = _SmallDevice(mla_decode_launch.mla_decode_split_kernel, num_stages=1, BLOCK_N=16)
    monkeypatch.setattr(mla_decode_launch, "mla_decode_split_kernel", small)
    gen = torch.Generator().manual_seed(3)
    rank, rope, heads, page_size, lens = 32, 8, 4, 4, [37, 5]
    kv_cache = torch.randn(24, page_size, rank + rope, generator=gen).to(DEVICE)
    page_table = torch.randperm(24, generator=gen)[:20].view(2, 10).int().to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q_nope = torch.randn(2, heads, rank, generator=gen).to(DEVICE)
    q_rope = torch.randn(2, heads, rope, generator=gen).to(DEVICE)
    size = portattn.mla_workspace_size(40, 2, heads, page_size, num_kv_splits=3, kv_lora_rank=rank)
    out = torch.full_like(q_nope, float("nan"))
    mla_decode_forward(
        q_nope, q_rope, kv_cache, page_table, seq_lens, out, scale=0.2, num_kv_splits=3,
        workspace=torch.empty(size, dtype=torch.uint8, device=DEVICE),
        tiles=MLATileConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
    )  # fmt: skip
    assert small.seen[-1] == {"num_stages": 1, "BLOCK_N": 16}
    ref = mla_decode_ref(q_nope, q_rope, kv_cache, page_table, seq_lens, scale=0.2)
    assert max_error(out, ref) < 1e-5


H200_SHARED = 232448  # bytes per program (shared_memory_per_block_optin)


@pytest.mark.parametrize("max_seqlen_q", [1, 40, 512])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_tiles_fit_shared_memory_up_front(head_dim, max_seqlen_q):
    """Every dtype gets tiles whose pipeline fits before anything compiles (fp32 halves what fits)."""
    for itemsize in (2, 4):
        tiles = launch.choose_tiles(
            max_seqlen_q, 4, head_dim, head_dim, interpret=False, itemsize=itemsize, shared_memory=H200_SHARED
        )
        assert launch.shared_memory_bytes(tiles, head_dim, head_dim, itemsize) <= H200_SHARED
        unbounded = launch.choose_tiles(max_seqlen_q, 4, head_dim, head_dim, interpret=False, itemsize=itemsize)
        if launch.shared_memory_bytes(unbounded, head_dim, head_dim, itemsize) <= H200_SHARED:
            assert tiles == unbounded  # tiles that fit are the tuned defaults


def test_fp32_prefill_tiles_at_head_dim_128_step_down_in_stages():
    # 128 x 128 tiles in 2 stages need 262144 bytes in float32 (the H200 refused them): one stage fits.
    bf16 = launch.choose_tiles(512, 4, 128, 128, interpret=False, itemsize=2, shared_memory=H200_SHARED)
    fp32 = launch.choose_tiles(512, 4, 128, 128, interpret=False, itemsize=4, shared_memory=H200_SHARED)
    assert (bf16.block_m, bf16.block_n, bf16.num_stages, bf16.pages_ahead) == (128, 128, 3, True)
    assert launch.shared_memory_bytes(bf16.__class__(32, 128, 128, 8, 2), 128, 128, 4) == 262144
    assert (fp32.block_m, fp32.block_n, fp32.num_stages, fp32.pages_ahead) == (128, 128, 1, False)


@pytest.mark.parametrize("head_dim", [40, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("max_seqlen_q", [1, 5, 40, 512])
def test_ieee_float32_tiles_compile_in_seconds(head_dim, max_seqlen_q):
    """IEEE float32 dots are unrolled into multiply-adds, BLOCK_M * BLOCK_N * columns per program: the
    tiles keep that at most 2048 per thread (64 x 32 x 128 in 4 warps; 128 x 128 x 128 in 8 warps is
    8192 and took 74 s to compile for sm_90), and still fit the shared memory."""
    tiles = launch.choose_tiles(
        max_seqlen_q, 4, head_dim, head_dim, interpret=False, itemsize=4, shared_memory=H200_SHARED, ieee_dots=True
    )
    columns = sum(launch.column_tiles(head_dim))
    assert tiles.block_m * tiles.block_n * columns / (32 * tiles.num_warps) <= 2048
    assert launch.shared_memory_bytes(tiles, head_dim, head_dim, 4) <= H200_SHARED
