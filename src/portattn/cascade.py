"""Merging attention states, and cascade (shared-prefix) attention built on it.

A query's attention over a key set split into disjoint parts is a weighted mean of its attention
over each part: with ``out_i`` the normalised output over part ``i`` and ``lse_i`` the log of that
part's softmax denominator (``return_lse=True`` of the ops),

    lse = log(sum_i exp(lse_i))            out = sum_i exp(lse_i - lse) * out_i

exactly (up to rounding). Cascade attention uses it for requests that share a prefix: the
shared keys are attended once by every request's queries together, each request's own keys
separately, and the two states are merged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends.base import AttentionBackend, Request
from .backends.cascade import CascadeMetadata, cascades, run_cascade
from .backends.registry import select_backend
from .errors import check_int, expect
from .ops import call_params, call_request, check_paged_inputs, new_lse
from .validation import FLOAT_DTYPES, check_tensor

__all__ = [
    "CascadeMetadata",
    "cascade_attention",
    "cascades",
    "merge_attention_states",
    "plan_cascade",
    "run_cascade",
]


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *more: torch.Tensor,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention outputs over disjoint key sets into the attention over their union.

    Shapes (any number of parts: ``more`` continues the ``out, lse`` pairs)::

        out_a, out_b, ...   [T, H, Dv]     one float dtype for all
        lse_a, lse_b, ...   [T, H]         float32 or float64, natural log (as the ops return it)
        -> out              [T, H, Dv]     dtype of out_a (written into ``out`` when given)
        -> lse              [T, H]         float32 (float64 for float64 outputs)

    For each row, ``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) * out_i``.
    A part whose LSE is -inf (it saw no key) has no weight, whatever its output holds; a row
    where every part is -inf gives zeros and -inf. The math runs in float32 (float64 for float64
    outputs); with more than two parts the running state stays in that precision and the output
    is rounded once. Sinks belong in exactly one part (an op's LSE includes them).

    Example: the attention of decode queries over a prefix and over the rest of their keys::

        o1, l1 = paged_attention(q, kc, vc, prefix_table, cu, prefix_lens, causal=False, return_lse=True)
        o2, l2 = paged_attention(q, kc, vc, rest_table, cu, rest_lens, return_lse=True)
        out, lse = merge_attention_states(o1, l1, o2, l2)

    Raises:
        ValueError: parts of different shapes, dtypes or devices ("expected ..., got ...");
            ``UnsupportedFeatureError`` if ``backend`` cannot merge (the ``sdpa`` backend).
    """
    expect(len(more) % 2 == 0, "outputs and LSEs in pairs (out, lse, out, lse, ...)", f"{4 + len(more)} tensors")
    outs = [out_a, out_b, *more[0::2]]
    lses = [lse_a, lse_b, *more[1::2]]
    check_tensor("out_a", out_a, 3, FLOAT_DTYPES, out_a.device if isinstance(out_a, torch.Tensor) else None)
    device, dtype, shape = out_a.device, out_a.dtype, tuple(out_a.shape)
    for i, (part, part_lse) in enumerate(zip(outs, lses)):
        name = "out_a" if i == 0 else "out_b" if i == 1 else f"output {i}"
        lse_name = "lse_a" if i == 0 else "lse_b" if i == 1 else f"LSE {i}"
        check_tensor(name, part, 3, (dtype,), device)
        expect(tuple(part.shape) == shape, f"{name} of shape {list(shape)} (as out_a)", list(part.shape))
        expect(part.stride(-1) == 1, f"{name} with a contiguous last dim (stride 1)", f"strides {part.stride()}")
        check_tensor(lse_name, part_lse, 2, (torch.float32, torch.float64), device)
        expect(tuple(part_lse.shape) == shape[:2], f"{lse_name} of shape {list(shape[:2])}", list(part_lse.shape))
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        check_tensor("out", out, 3, (dtype,), device)
        expect(tuple(out.shape) == shape, f"out of shape {list(shape)}", list(out.shape))
        expect(out.stride(-1) == 1, "out with a contiguous last dim (stride 1)", f"strides {out.stride()}")
    out_lse = new_lse(out)
    impl = select_backend("attention", backend, Request("merge_attention_states", device.type, dtype, None))
    return impl.merge_attention_states(outs, lses, out, out_lse)


def plan_cascade(
    backend: AttentionBackend,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    page_size: int,
    shared_prefix_len: int,
    *,
    num_heads: int,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> CascadeMetadata:
    """Plan both passes with ``backend`` (host syncs happen here; :func:`run_cascade` then only launches).

    Inputs as :func:`cascade_attention` takes them, already validated. ``host_lens = (q_lens,
    k_lens)``: the lengths as the caller has them on the host (an engine's plan), so that planning
    does not read them back from the device. ``kv_dtype``: the cache's (``plan_paged`` takes it).
    """
    device = seq_lens_k.device
    shared_pages = shared_prefix_len // page_size
    own_lens = None
    if host_lens is not None:
        own_lens = (host_lens[0], [k - shared_prefix_len for k in host_lens[1]])
    own = backend.plan_paged(
        cu_seqlens_q,
        seq_lens_k - shared_prefix_len,
        page_table[:, shared_pages:],  # [B, max_pages - shared_pages], a view
        page_size,
        num_heads=num_heads,
        host_lens=own_lens,
        kv_dtype=kv_dtype,
    )
    num_tokens = sum(own.q_lens)
    if shared_prefix_len == 0 or num_tokens == 0:
        return CascadeMetadata(None, own, shared_prefix_len)
    # Every query of the batch attends the shared pages in one sequence: positions do not matter
    # there (no causal mask, no window), so its queries may outnumber its keys.
    shared = backend.plan_paged(
        torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        torch.tensor([shared_prefix_len], dtype=torch.int32, device=device),
        page_table[:1, :shared_pages],
        page_size,
        num_heads=num_heads,
        host_lens=((num_tokens,), (shared_prefix_len,)),
        kv_dtype=kv_dtype,
    )
    return CascadeMetadata(shared, own, shared_prefix_len)


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    shared_prefix_len: int,
    *,
    scale: float | None = None,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
    logit_softcap: float = 0.0,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention` for a batch whose sequences share their first ``shared_prefix_len`` keys.

    Arguments are those of :func:`paged_attention` (same shapes; ``page_table`` holds each
    request's full row) plus ``shared_prefix_len = S``: every row's first ``S / P`` page ids are
    the same pages. The result equals ``paged_attention`` over the full sequences, computed as

    1. the shared pass: all ``T`` queries as one sequence, non-causal, over the shared pages
       (each shared page is read by one program per query block, not once per request);
    2. the own pass: each request over its keys ``S .. L - 1`` (its row past the shared pages),
       causal or not as asked, with the sinks;
    3. :func:`merge_attention_states` of the two, from float32 partial states.

    Example (``P = 2``, ``S = 4``): rows ``[7, 3, 5, ...]`` and ``[7, 3, 0, 9, ...]`` share pages
    7 and 3; the shared pass reads them once for both requests' queries, the own pass reads page
    5 for the first and pages 0, 9 for the second.

    ``S`` must be a multiple of the page size, and each request's new tokens lie past it
    (``seq_lens_k[b] - n_b >= S``). Windows, chunks and ALiBi depend on positions that the
    shared pass does not keep: use :func:`paged_attention` for those. ``return_lse`` as in
    :func:`paged_attention`. Each call plans (one host sync); engines call :func:`plan_cascade`
    once per forward and :func:`run_cascade` per layer.

    Raises:
        ValueError: as :func:`paged_attention`, or rows that do not share their first ``S / P``
            pages, ``S`` not a multiple of the page size, or new tokens inside the shared prefix.
    """
    page_size, value_dim, q_lens, k_lens = check_paged_inputs(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k)
    device = q.device
    num_tokens, num_q_heads, _ = q.shape
    check_int("shared_prefix_len", shared_prefix_len, 0)
    expect(
        shared_prefix_len % page_size == 0,
        f"shared_prefix_len a multiple of the page size {page_size} (whole shared pages)",
        shared_prefix_len,
    )
    for b, (n, num_keys) in enumerate(zip(q_lens, k_lens)):
        expect(
            num_keys - n >= shared_prefix_len,
            f"sequence {b}'s {n} new tokens past the shared prefix (seq_lens_k - n >= {shared_prefix_len})",
            f"seq_lens_k[{b}] = {num_keys}",
        )
    shared_pages = shared_prefix_len // page_size
    if shared_pages and len(k_lens) > 1:
        differs = page_table[1:, :shared_pages] != page_table[:1, :shared_pages]  # [B - 1, S / P]
        if bool(differs.any()):
            row, col = (int(i) for i in differs.nonzero()[0])
            expect(
                False,
                f"page_table rows that share their first {shared_pages} pages (the shared prefix)",
                f"page_table[{row + 1}, {col}] = {int(page_table[row + 1, col])} != page_table[0, {col}] "
                f"= {int(page_table[0, col])}",
            )
    params = call_params(q, scale, causal, sinks, logit_softcap)
    both_passes = frozenset({"non_causal"})  # the shared pass is non-causal; the merge needs each pass's LSE
    extra_ops = frozenset({"merge_attention_states"})
    request = call_request("paged_attention", q, value_dim, params, True, both_passes, extra_ops=extra_ops)
    impl = select_backend("attention", backend, request)
    metadata = plan_cascade(
        impl, page_table, cu_seqlens_q, seq_lens_k, page_size, shared_prefix_len, num_heads=num_q_heads,
        kv_dtype=k_cache.dtype,
    )  # fmt: skip
    out = torch.empty((num_tokens, num_q_heads, value_dim), dtype=q.dtype, device=device)
    lse = new_lse(q) if return_lse else None
    run_cascade(impl, metadata, q, k_cache, v_cache, params, out, lse)
    return (out, lse) if return_lse else out
