"""A backend's graph plan (init_graph_buffers, graph_metadata once, plan_into per step) against its
per-step plan, for every attention feature and uniform steps of 1, 2 and 5 new tokens per sequence
(decodes, and the verification steps of speculative decoding): the plan is built once and the op
recorded once (a captured graph where torch has graphs for the device, the same call re-run
elsewhere), then replayed for steps of other lengths, page tables and batch padding. Unowned slots
hold NaN."""

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
UNIFORM_Q_LENS = [1, 2, 5]
MAX_BATCH, MAX_CONTEXT, MAX_Q_LEN = 4, 48, 5
HQ, HKV, D = 4, 2, 64
# Each step: key counts of its sequences (the last q keys are the step's new tokens; counts below q
# are raised to q); 3 sequences run padded to the batch of 4. Lengths cross page and chunk boundaries.
STEPS = [[9, 1, 30, 17], [10, 2, 31], [33, 8, 16, 47]]


def cases() -> list:
    """(backend, dtype, page size, uniform_q_len, feature): every graph backend, q_len 2 at one page
    size; under Triton's CPU interpreter (it runs each kernel call in Python) one dtype and one page
    size, and q_len 5 only for the masks that the new tokens' positions move (window, chunk)."""
    out = []
    for b in BACKENDS:
        if not backend_class(b).supports_graphs:
            continue
        interpreted = b == "triton" and is_triton_interpreter()
        for dtype in dtypes_for(b)[: 1 if interpreted else 2]:
            for p in [3] if interpreted else PAGE_SIZES:
                for q in UNIFORM_Q_LENS:
                    for f in FEATURES:
                        if interpreted and not (q == 1 or (q == 5 and f in ("window", "chunk"))):
                            continue
                        if q == 2 and p != 3:
                            continue
                        out.append(pytest.param(b, dtype, p, q, f, id=f"{b}-{dtype}-P{p}-q{q}-{f}"))
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


@pytest.mark.parametrize("backend,dtype,page_size,q_len,feature", cases())
def test_graph_plan_replays_equal_per_step_plans(backend, dtype, page_size, q_len, feature):
    impl = backend_class(backend)()
    options = dict(FEATURES[feature])
    if options.pop("sinks", False):
        options["sinks"] = torch.linspace(-1.0, 2.0, HQ, device=DEVICE)
    params = AttentionParams(scale=D**-0.5, **options)
    k, v, req_to_token, scratch = pool(page_size, dtype, seed=page_size)
    max_pages = req_to_token.shape[1] // page_size
    device = torch.device(DEVICE)
    # Buffers for the longest uniform step; this plan reads the first q_len columns of each row.
    buffers = impl.init_graph_buffers(
        MAX_BATCH, max_pages, page_size, device, num_heads=HQ, max_uniform_q_len=MAX_Q_LEN
    )
    metadata = impl.graph_metadata(buffers, MAX_BATCH, num_heads=HQ, uniform_q_len=q_len)
    assert metadata.q_lens is None and metadata.k_lens is None and metadata.max_seqlen_q == q_len
    assert metadata.cu_seqlens_q.tolist() == list(range(0, MAX_BATCH * q_len + 1, q_len))
    q_static = torch.zeros(MAX_BATCH * q_len, HQ, D, dtype=dtype, device=DEVICE)
    out_static = torch.zeros(MAX_BATCH * q_len, HQ, D, dtype=dtype, device=DEVICE)

    def op():
        impl.paged_attention(q_static, k, v, metadata, params, out_static)

    fill_step(k, v, req_to_token, [q_len] * MAX_BATCH, page_size, seed=0)
    rows = torch.arange(MAX_BATCH, device=DEVICE)
    seq_lens = torch.full((MAX_BATCH,), q_len, dtype=torch.int32, device=DEVICE)
    impl.plan_into(buffers, req_to_token, rows, seq_lens, uniform_q_len=q_len)
    op()  # compiles
    graph = None
    if devices.graph_support(DEVICE) is not None:
        graph = devices.new_graph(DEVICE)
        with devices.graph_capture(DEVICE, graph):
            op()

    for step, lens in enumerate(STEPS):
        lens = [max(n, q_len) for n in lens]
        fill_step(k, v, req_to_token, lens, page_size, seed=step + 1)
        n, tokens = len(lens), len(lens) * q_len
        q = torch.randn(tokens, HQ, D, generator=torch.Generator().manual_seed(step)).to(DEVICE, dtype)
        seq_lens = torch.tensor(lens + [q_len] * (MAX_BATCH - n), dtype=torch.int32, device=DEVICE)
        step_rows = torch.tensor(list(range(n)) + [MAX_BATCH] * (MAX_BATCH - n), device=DEVICE)  # pads: scratch
        impl.plan_into(buffers, req_to_token, step_rows, seq_lens, uniform_q_len=q_len)
        # The new tokens' slots: the last q_len keys of each sequence, sequence-major; pads in the scratch page.
        want_slots = [int(req_to_token[b, j]) for b in range(n) for j in range(lens[b] - q_len, lens[b])]
        assert buffers.out_cache_loc[:tokens].tolist() == want_slots
        pad_slots = buffers.out_cache_loc[tokens : MAX_BATCH * q_len]
        assert torch.equal(pad_slots // page_size, torch.full_like(pad_slots, scratch))
        k.view(-1, HKV, D)[pad_slots] = 0.0  # a padding row's own keys: finite
        v.view(-1, HKV, D)[pad_slots] = 0.0
        q_static.zero_()
        q_static[:tokens] = q
        if graph is not None:
            graph.replay()
        else:
            op()

        # The per-step plan of the same sequences, without padding.
        cu = torch.arange(n + 1, dtype=torch.int32, device=DEVICE) * q_len
        page_table = to_page_table(req_to_token[:n], page_size)
        eager = impl.plan_paged(cu, seq_lens[:n], page_table, page_size, num_heads=HQ)
        want = impl.paged_attention(q, k, v, eager, params, torch.empty_like(q))
        got = out_static[:tokens]
        assert not got.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())


def test_a_step_longer_than_the_buffers_is_refused():
    impl = backend_class("torch")()
    buffers = impl.init_graph_buffers(2, 4, 4, torch.device("cpu"), num_heads=HQ, max_uniform_q_len=3)
    with pytest.raises(ValueError, match=r"expected uniform_q_len in \[1, 3\], got 4"):
        impl.graph_metadata(buffers, 2, num_heads=HQ, uniform_q_len=4)
    rows, lens = torch.zeros(2, dtype=torch.int64), torch.full((2,), 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expected uniform_q_len in \[1, 3\], got 4"):
        impl.plan_into(buffers, torch.zeros((3, 16), dtype=torch.int32), rows, lens, uniform_q_len=4)
    with pytest.raises(ValueError, match=r"expected batch_size in \[1, 2\], got 3"):
        impl.graph_metadata(buffers, 3, num_heads=HQ)
