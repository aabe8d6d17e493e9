"""A backend's graph plan (init_graph_buffers, graph_metadata once, plan_into per step) against its
per-step plan, for every attention feature: the plan is built once and the op recorded once (a
captured graph where torch has graphs for the device, the same call re-run elsewhere), then replayed
for steps of other lengths, page tables and batch padding. Unowned slots hold NaN."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS, DEVICE, dtypes_for
from portattn import device as devices
from portattn.backends.base import AttentionParams
from portattn.backends.registry import backend_class
from portattn.device import is_triton_interpreter
from portattn.paging import to_page_table

PAGE_SIZES = [1, 3, 16]
FEATURES = {
    "plain": {},
    "window": dict(window_left=6),
    "chunk": dict(attention_chunk_size=8),
    "sinks": dict(sinks=True),
    "softcap": dict(logit_softcap=5.0),
}
MAX_BATCH, MAX_CONTEXT = 4, 48
HQ, HKV, D = 4, 2, 64
# Each step: key counts of its sequences (the last key is the step's new token); 3 sequences run
# padded to the batch of 4. Lengths cross page and chunk boundaries.
STEPS = [[9, 1, 30, 17], [10, 2, 31], [33, 8, 16, 47]]


def cases() -> list:
    """(backend, dtype, page size): every graph backend; under Triton's CPU interpreter one dtype and
    one page size (it runs each kernel call in Python)."""
    out = []
    for b in BACKENDS:
        if not backend_class(b).supports_graphs:
            continue
        interpreted = b == "triton" and is_triton_interpreter()
        for dtype in dtypes_for(b)[: 1 if interpreted else 2]:
            out += [pytest.param(b, dtype, p, id=f"{b}-{dtype}-P{p}") for p in ([3] if interpreted else PAGE_SIZES)]
    return out


def pool(page_size: int, dtype: torch.dtype, seed: int):
    """Caches with one scratch page (the last) and NaN in every slot; req_to_token with a scratch row."""
    num_pages = MAX_BATCH * (-(-MAX_CONTEXT // page_size)) + 1
    k = torch.full((num_pages, page_size, HKV, D), float("nan"), dtype=dtype, device=DEVICE)
    v = torch.full_like(k, float("nan"))
    width = -(-MAX_CONTEXT // page_size) * page_size
    req_to_token = torch.zeros((MAX_BATCH + 1, width), dtype=torch.int32, device=DEVICE)
    scratch = num_pages - 1
    req_to_token[MAX_BATCH] = scratch * page_size + torch.arange(width, device=DEVICE, dtype=torch.int32) % page_size
    return k, v, req_to_token, scratch


def fill_step(k, v, req_to_token, lens: list[int], page_size: int, seed: int) -> None:
    """Fresh random pages for each sequence, its keys written, every other slot NaN (scratch included)."""
    g = torch.Generator().manual_seed(seed)
    k.fill_(float("nan"))
    v.fill_(float("nan"))
    num_pages = k.shape[0] - 1
    order = torch.randperm(num_pages, generator=g).tolist()
    for row, n in enumerate(lens):
        pages = [order.pop() for _ in range(-(-n // page_size))]
        slots = torch.tensor([pages[j // page_size] * page_size + j % page_size for j in range(n)], dtype=torch.int32)
        req_to_token[row, :n] = slots.to(DEVICE)
        req_to_token[row, n:] = 0  # junk: page 0, whatever it holds
        k.view(-1, HKV, D)[slots.long()] = torch.randn(n, HKV, D, generator=g).to(DEVICE, k.dtype)
        v.view(-1, HKV, D)[slots.long()] = torch.randn(n, HKV, D, generator=g).to(DEVICE, v.dtype)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend,dtype,page_size", cases())
def test_graph_plan_replays_equal_per_step_plans(backend, dtype, page_size, feature):
    impl = backend_class(backend)()
    options = dict(FEATURES[feature])
    if options.pop("sinks", False):
        options["sinks"] = torch.linspace(-1.0, 2.0, HQ, device=DEVICE)
    params = AttentionParams(scale=D**-0.5, **options)
    k, v, req_to_token, scratch = pool(page_size, dtype, seed=page_size)
    max_pages = req_to_token.shape[1] // page_size
    buffers = impl.init_graph_buffers(MAX_BATCH, max_pages, page_size, torch.device(DEVICE), num_heads=HQ)
    metadata = impl.graph_metadata(buffers, MAX_BATCH, num_heads=HQ)
    assert metadata.q_lens is None and metadata.k_lens is None
    q_static = torch.zeros(MAX_BATCH, HQ, D, dtype=dtype, device=DEVICE)
    out_static = torch.zeros(MAX_BATCH, HQ, D, dtype=dtype, device=DEVICE)

    def op():
        impl.paged_attention(q_static, k, v, metadata, params, out_static)

    fill_step(k, v, req_to_token, [1] * MAX_BATCH, page_size, seed=0)
    rows = torch.arange(MAX_BATCH, device=DEVICE)
    impl.plan_into(buffers, req_to_token, rows, torch.ones(MAX_BATCH, dtype=torch.int32, device=DEVICE))
    op()  # compiles
    graph = None
    if devices.graph_support(DEVICE) is not None:
        graph = devices.new_graph(DEVICE)
        with devices.graph_capture(DEVICE, graph):
            op()

    for step, lens in enumerate(STEPS):
        fill_step(k, v, req_to_token, lens, page_size, seed=step + 1)
        n = len(lens)
        q = torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(step)).to(DEVICE, dtype)
        seq_lens = torch.tensor(lens + [1] * (MAX_BATCH - n), dtype=torch.int32, device=DEVICE)
        step_rows = torch.tensor(list(range(n)) + [MAX_BATCH] * (MAX_BATCH - n), device=DEVICE)  # pads: scratch
        impl.plan_into(buffers, req_to_token, step_rows, seq_lens)
        assert torch.equal(buffers.out_cache_loc[n:MAX_BATCH] // page_size, torch.full_like(seq_lens[n:], scratch))
        k.view(-1, HKV, D)[buffers.out_cache_loc[n:MAX_BATCH]] = 0.0  # a padding row's own key: finite
        v.view(-1, HKV, D)[buffers.out_cache_loc[n:MAX_BATCH]] = 0.0
        q_static.zero_()
        q_static[:n] = q
        if graph is not None:
            graph.replay()
        else:
            op()

        # The per-step plan of the same sequences, without padding.
        cu = torch.arange(n + 1, dtype=torch.int32, device=DEVICE)
        page_table = to_page_table(req_to_token[:n], page_size)
        eager = impl.plan_paged(cu, seq_lens[:n], page_table, page_size, num_heads=HQ)
        want = impl.paged_attention(q, k, v, eager, params, torch.empty_like(q))
        got = out_static[:n]
        assert not got.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())
