"""Unsplit decodes choose their tiles by how many programs each SM holds (``choose_tiles(decode_waves=)``):
the rule's bands, what the launcher passes it, and the three tile shapes against the float64 reference
(page sizes 1, 7, 16 with lengths P - 1, P, P + 1 and longer, unused slots poisoned with NaN)."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.testing import make_paged_case, max_error, paged_attention_ref

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.device import compute_units
    from portattn.kernels.triton import launch
    from portattn.kernels.triton.launch import TileConfig, attention_forward, batched_decode_tiles, choose_tiles


def decode_tiles(waves, **kw):
    t = choose_tiles(1, 4, 128, 128, interpret=False, kv_itemsize=2, decode_waves=waves, **kw)
    return t.block_n, t.num_warps, t.num_stages, t.pages_ahead


@pytest.mark.parametrize(
    "waves, want",
    [(7.8, (64, 4, 3, False)), (3.0, (64, 4, 3, False)), (2.9, (128, 4, 2, False)), (1.01, (128, 4, 2, False)),
     (1.0, (128, 4, 3, True)), (0.06, (128, 4, 3, True)), (None, (64, 8, 5, False))],
)  # fmt: skip
def test_the_bands(waves, want):
    assert decode_tiles(waves) == want


def test_other_decodes_keep_their_tiles():
    plain = decode_tiles(None)
    fp8 = choose_tiles(1, 4, 128, 128, interpret=False, kv_itemsize=1, decode_waves=4.0)
    assert (fp8.block_n, fp8.num_warps, fp8.num_stages) == (128, 4, 2)  # the fp8 decode's own rule
    fp32 = choose_tiles(1, 4, 128, 128, interpret=False, itemsize=4, kv_itemsize=4, decode_waves=4.0)
    assert (fp32.block_n, fp32.num_warps, fp32.num_stages) == plain[:3]
    narrow = choose_tiles(1, 4, 64, 64, interpret=False, kv_itemsize=2, decode_waves=4.0)
    assert (narrow.block_n, narrow.num_warps, narrow.num_stages) == plain[:3]
    short = choose_tiles(1, 4, 128, 128, interpret=False, kv_itemsize=2, short_splits=True, decode_waves=None)
    assert (short.block_n, short.num_warps, short.num_stages) == (32, 4, 2)
    run = choose_tiles(64, 4, 128, 128, interpret=False, kv_itemsize=2, decode_waves=4.0)
    assert run.block_m == 128  # a query run is no decode


def test_the_launcher_passes_programs_per_sm(monkeypatch):
    seen = []
    real = launch.choose_tiles

    def spy(*args, **kw):
        seen.append((args[0], kw["decode_waves"]))
        return real(*args, **kw)

    monkeypatch.setattr(launch, "choose_tiles", spy)
    case = make_paged_case([1] * 5, [3, 9, 16, 17, 30], page_size=16, dtype=torch.float32, device=DEVICE, seed=1)
    for splits, max_q in ((1, 1), (2, 1)):
        out = torch.empty_like(case.q)
        attention_forward(
            case.q, case.k_cache, case.v_cache, out, case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=max_q,
            scale=0.125, page_table=case.page_table, num_kv_splits=splits,
        )  # fmt: skip
    query_run = make_paged_case([3, 2], [9, 20], page_size=16, dtype=torch.float32, device=DEVICE, seed=2)
    out = torch.empty_like(query_run.q)
    attention_forward(
        query_run.q, query_run.k_cache, query_run.v_cache, out, query_run.cu_seqlens_q, query_run.seq_lens_k,
        max_seqlen_q=3, scale=0.125, page_table=query_run.page_table, num_kv_splits=1,
    )  # fmt: skip
    assert seen == [(1, 5 * 2 / compute_units(DEVICE)), (1, None), (3, None)]


@pytest.mark.parametrize("waves", [4.0, 2.0, 0.5], ids=["many", "some", "few"])
@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_each_band_against_the_reference(waves, page_size):
    block_n, num_warps, num_stages = batched_decode_tiles(waves)
    tiles = TileConfig(4, 16, block_n, num_warps, num_stages, pages_ahead=waves <= 1)
    k_lens = [page_size - 1 or 1, page_size, page_size + 1, 1, 130, 2 * block_n + 3]
    case = make_paged_case(
        [1] * len(k_lens), k_lens, page_size=page_size, num_q_heads=8, num_kv_heads=2, head_dim=128,
        dtype=torch.float16, device=DEVICE, seed=page_size,
    )  # fmt: skip
    out = torch.full_like(case.q, float("nan"))
    attention_forward(
        case.q, case.k_cache, case.v_cache, out, case.cu_seqlens_q, case.seq_lens_k, max_seqlen_q=1, scale=0.125,
        page_table=case.page_table, num_kv_splits=1, tiles=tiles,
    )  # fmt: skip
    assert not out.isnan().any()
    assert max_error(out, paged_attention_ref(**case.inputs(), scale=0.125)) < 2e-3
