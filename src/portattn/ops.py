"""The functional attention ops: validate, pick a backend, plan, run.

These are public so that other engines can call them with their own page tables. Each call plans
(one host sync) and runs; an engine that runs many layers over one batch should call the backend's
``plan_*`` once and its op method per layer instead.
"""

from __future__ import annotations

import dataclasses

import torch

from .backends.base import AttentionParams, Request
from .backends.registry import select_backend
from .errors import expect, is_int
from .kv_quant import FP8_DTYPES, check_scale
from .validation import (
    FLOAT_DTYPES,
    attention_params,
    check_cu_seqlens,
    check_head_groups,
    check_out,
    check_page_table,
    check_sizes,
    check_tensor,
)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window_left: int = -1,
    attention_chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    logit_softcap: float = 0.0,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    window_right: int = -1,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    check: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new query tokens over a paged KV cache (decode, extend, prefill, mixed).

    Shapes (``T`` query tokens in ``B`` sequences, ``P`` = page size)::

        q            [T, Hq, D]
        k_cache      [num_pages, P, Hkv, D]     Hq % Hkv == 0 (MHA, GQA, MQA)
        v_cache      [num_pages, P, Hkv, Dv]    dtype of q, or both float8_e4m3fn / float8_e5m2
        page_table   [B, max_pages] int32       page-granular: column p = physical page of
                                                logical page p (see portattn.to_page_table)
        cu_seqlens_q [B + 1] int32              queries of sequence b are q[cu[b]:cu[b+1]]
        seq_lens_k   [B] int32                  keys of sequence b, the new tokens included
        -> out       [T, Hq, Dv]                dtype of q
        -> lse       [T, Hq] float32            with return_lse=True (float64 for float64 q)

    The keys of sequence ``b`` are its first ``seq_lens_k[b]`` slots; the new tokens' K/V must
    already be in the cache. Queries are bottom-right aligned: query ``i`` of ``n`` sits at
    position ``L - n + i``. Example with ``P = 2``: a sequence of 5 keys in physical pages 6, 1, 4
    has the row ``[6, 1, 4, <anything>...]``; a decode step is ``n = 1`` at position 4. A
    sequence may have more queries than keys (``n > L``, as in ``varlen_attention``): its first
    ``n - L`` queries sit at negative positions and, under ``causal``, see no key.

    The trap: ``req_to_token`` rows are token-granular (one slot per token, ``page * P +
    offset``); passed here they run without error whenever their slot numbers happen to be valid
    page ids, and attention reads the wrong pages. Convert them with ``portattn.to_page_table``:
    its result is a ``PageTable`` whose page size the op checks against ``k_cache``. Raw tables
    are checked fully with ``check=True`` (default: the ``PORTATTN_DEBUG`` environment variable):
    page ids in range, no page twice in a row or shared between rows outside a common prefix, and
    no column per key where fewer columns hold the keys (``validation.check_page_table``); this
    costs a host pass over the table.

    Masks: ``causal`` (key ``j <= p``); ``window_left = W`` (also ``j >= p - W``, -1 = off; a
    Hugging Face ``sliding_window = S`` is ``W = S - 1``); ``attention_chunk_size = C`` (also
    ``j // C == p // C``, absolute positions); ``window_right = R`` (only with ``causal=False``:
    ``j <= p + R``, -1 = unbounded; a causal call takes -1 or 0). With ``L = 8`` keys, 3
    queries, ``causal=False, window_left=1, window_right=2`` (``x`` = visible)::

        p=5  . . . . x x x x        (j <= 7: the last key bounds the window)
        p=6  . . . . . x x x
        p=7  . . . . . . x x

    ``sinks [Hq]`` adds one logit per head to the softmax denominator; ``logit_softcap = c`` maps
    scores to ``c * tanh(s / c)`` before masking. ``alibi_slopes [Hq]`` (float) adds the bias
    ``-slope[h] * |p - j|`` to the scaled (and softcapped) score, as FlashAttention defines it
    (``-slope * (p - j)`` for a causal mask). ``scale`` defaults to ``1 / sqrt(D)``. A query that
    sees no key returns zeros.

    ``return_lse=True`` returns ``(out, lse)``: ``lse[t, h] = log(sum_j exp(s_j) + exp(sink_h))``
    over the keys the row sees (natural log, biases and softcap included in ``s_j``; the sink term
    only with ``sinks``). A row that sees no key gets -inf (the sink itself when ``sinks`` are
    given). Partial results over disjoint key sets merge exactly with
    :func:`portattn.merge_attention_states`.

    fp8 caches (``float8_e4m3fn`` or ``float8_e5m2``, K and V alike): key ``j`` is
    ``k_scale * k_cache[slot_j]`` and its value ``v_scale * v_cache[slot_j]`` (per-layer scales,
    positive floats; write with :func:`portattn.kv_quant.quantize_kv`, which saturates). ``q`` and
    the output stay in the model's dtype; kernels dequantise in registers (``k_scale`` folded into
    the softmax scale, ``v_scale`` into the output). With a cache in ``q``'s dtype both scales
    must be 1.0. A backend that does not list the cache dtype raises ``UnsupportedFeatureError``.

    Raises:
        ValueError: inputs of the wrong shape, dtype, device or value (the message says what was
            expected and what came); ``UnsupportedFeatureError`` if ``backend`` lacks a feature.
    """
    page_size, value_dim, _, _ = check_paged_inputs(
        q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k, kv_dtypes=FP8_DTYPES, check=check
    )
    quantized = k_cache.dtype != q.dtype
    k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    expect(quantized or k_scale == v_scale == 1.0, f"scales 1.0 with a {q.dtype} cache", (k_scale, v_scale))
    num_tokens, num_q_heads, _ = q.shape
    expect(
        window_right in (-1, 0) or not causal,
        "window_right -1 or 0 with causal=True (it applies to non-causal calls)",
        window_right,
    )
    window = (window_left, -1 if causal else window_right)
    params = call_params(q, scale, causal, sinks, logit_softcap, alibi_slopes, window, attention_chunk_size)
    if quantized:
        params = dataclasses.replace(params, k_scale=k_scale, v_scale=v_scale)
    out = check_out(out, (num_tokens, num_q_heads, value_dim), q)
    lse = new_lse(q) if return_lse else None
    request = call_request(
        "paged_attention", q, value_dim, params, return_lse, kv_dtype=k_cache.dtype if quantized else None
    )
    impl = select_backend("attention", backend, request)
    metadata = impl.plan_paged(
        cu_seqlens_q,
        seq_lens_k,
        page_table,
        page_size,
        attention_chunk_size=attention_chunk_size,
        num_heads=num_q_heads,
        kv_dtype=k_cache.dtype,
    )
    if not return_lse:  # backends that do not declare "lse" keep the six-argument form
        return impl.paged_attention(q, k_cache, v_cache, metadata, params, out)
    return impl.paged_attention(q, k_cache, v_cache, metadata, params, out, lse=lse), lse


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    kv_dtypes: tuple[torch.dtype, ...] = (),
    check: bool | None = None,
) -> tuple[int, int, list[int], list[int]]:
    """Validate the tensors of a paged call (as :func:`paged_attention` takes them; ``check`` as there).

    The caches are in ``q``'s dtype or, both alike, one of ``kv_dtypes`` (quantised caches).
    Returns ``(page_size, Dv, q_lens, k_lens)``, the lengths as host lists.
    """
    check_tensor("q", q, 3, FLOAT_DTYPES, q.device if isinstance(q, torch.Tensor) else None)
    device = q.device
    num_tokens, num_q_heads, head_dim = q.shape
    check_tensor("k_cache", k_cache, 4, (q.dtype, *kv_dtypes), device)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), device)
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    value_dim = v_cache.shape[3]
    check_sizes({"query heads (q.shape[1])": num_q_heads, "head dim (q.shape[2])": head_dim})
    check_sizes({"page size (k_cache.shape[1])": page_size, "value head dim (v_cache.shape[3])": value_dim})
    expect(k_cache.shape[3] == head_dim, f"k_cache head dim {head_dim} (as q)", k_cache.shape[3])
    expect(
        tuple(v_cache.shape[:3]) == (num_pages, page_size, num_kv_heads),
        f"v_cache of shape [{num_pages}, {page_size}, {num_kv_heads}, Dv] (as k_cache)",
        list(v_cache.shape),
    )
    check_head_groups(num_q_heads, num_kv_heads)
    check_tensor("page_table", page_table, 2, (torch.int32,), device)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), device)
    check_tensor("seq_lens_k", seq_lens_k, 1, (torch.int32,), device)
    batch = seq_lens_k.shape[0]
    expect(cu_seqlens_q.shape[0] == batch + 1, f"cu_seqlens_q of shape [{batch + 1}] (B + 1)", list(cu_seqlens_q.shape))
    expect(page_table.shape[0] == batch, f"page_table with {batch} rows (one per sequence)", list(page_table.shape))
    q_lens = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, num_tokens)
    k_lens = seq_lens_k.tolist()
    bad = next((b for b, n in enumerate(k_lens) if n < 0), None)
    expect(bad is None, "seq_lens_k >= 0", f"seq_lens_k[{bad}] = {k_lens[bad]}" if bad is not None else "")
    check_page_table(page_table, k_lens, seq_lens_k, page_size, num_pages, check=check)
    return page_size, value_dim, q_lens, k_lens


def with_alibi(
    params: AttentionParams, alibi_slopes: torch.Tensor | None, num_q_heads: int, device: torch.device
) -> AttentionParams:
    """``params`` with validated ALiBi slopes (``[Hq]``, a float dtype) added."""
    if alibi_slopes is None:
        return params
    check_tensor("alibi_slopes", alibi_slopes, 1, FLOAT_DTYPES, device)
    expect(
        alibi_slopes.shape[0] == num_q_heads,
        f"alibi_slopes of shape [{num_q_heads}] (one per query head)",
        tuple(alibi_slopes.shape),
    )
    return dataclasses.replace(params, alibi_slopes=alibi_slopes)


def call_params(
    q: torch.Tensor,
    scale: float | None,
    causal: bool,
    sinks: torch.Tensor | None,
    logit_softcap: float,
    alibi_slopes: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    attention_chunk_size: int | None = None,
) -> AttentionParams:
    """Validated :class:`AttentionParams` of a call on ``q [T, Hq, D]``: ``window`` is ``(window_left,
    window_right)`` as :func:`attention_params` takes them; ``alibi_slopes`` as :func:`with_alibi`."""
    _, num_q_heads, head_dim = q.shape
    params = attention_params(
        head_dim=head_dim,
        num_q_heads=num_q_heads,
        scale=scale,
        causal=causal,
        window_left=window[0],
        window_right=window[1],
        attention_chunk_size=attention_chunk_size,
        sinks=sinks,
        logit_softcap=logit_softcap,
        device=q.device,
    )
    return with_alibi(params, alibi_slopes, num_q_heads, q.device)


def call_request(
    op: str,
    q: torch.Tensor,
    value_dim: int,
    params: AttentionParams,
    return_lse: bool,
    extra_features: frozenset[str] = frozenset(),
    **fields,
) -> Request:
    """The backend :class:`Request` of ``op`` on ``q [T, Hq, D]`` with ``params``: the features they
    need, ``lse`` with ``return_lse``, and ``extra_features``; ``fields`` are further :class:`Request` fields."""
    head_dim = q.shape[2]
    features = params.features(head_dim, value_dim) | ({"lse"} if return_lse else set()) | extra_features
    return Request(op, q.device.type, q.dtype, head_dim, features, value_dim=value_dim, **fields)


def new_lse(q: torch.Tensor) -> torch.Tensor:
    """An LSE buffer ``[T, Hq]`` for ``q [T, Hq, D]``: float32, or float64 for float64 inputs."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty(q.shape[:2], dtype=dtype, device=q.device)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    logit_softcap: float = 0.0,
    backend: str = "auto",
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences (vision encoders, dense prefill).

    Shapes::

        q            [Tq, Hq, D]        cu_seqlens_q [B + 1] int32
        k            [Tk, Hkv, D]       cu_seqlens_k [B + 1] int32 (default: cu_seqlens_q)
        v            [Tk, Hkv, Dv]
        -> out       [Tq, Hq, Dv]       dtype of q
        -> lse       [Tq, Hq] float32   with return_lse=True (float64 for float64 q)

    Sequence ``b`` attends only within itself. Queries are bottom-right aligned (query ``i`` of
    ``n`` over ``L`` keys sits at position ``L - n + i``). ``window_size = (left, right)`` follows
    FlashAttention: key ``j`` is visible to position ``p`` iff ``p - left <= j <= p + right``, -1
    meaning unbounded; ``causal`` forces ``right = 0``. ``max_seqlen_*`` are optional hints; when
    given they must be at least the longest sequence. A query that sees no key returns zeros.
    ``sinks``, ``logit_softcap``, ``alibi_slopes`` and ``return_lse`` are as in
    :func:`paged_attention` (ALiBi: ``-slope * |p - j|`` with the positions above).
    Backend selection uses the ``mm`` kind (``PORTATTN_MM_ATTENTION_BACKEND``).
    """
    check_tensor("q", q, 3, FLOAT_DTYPES, q.device if isinstance(q, torch.Tensor) else None)
    device = q.device
    num_tokens, num_q_heads, head_dim = q.shape
    check_tensor("k", k, 3, (q.dtype,), device)
    check_tensor("v", v, 3, (q.dtype,), device)
    num_keys, num_kv_heads = k.shape[:2]
    value_dim = v.shape[2]
    check_sizes({"query heads (q.shape[1])": num_q_heads, "head dim (q.shape[2])": head_dim})
    expect(
        k.shape[2] == head_dim, f"k of shape [{num_keys}, {num_kv_heads}, {head_dim}] (head dim as q)", list(k.shape)
    )
    expect(
        tuple(v.shape[:2]) == (num_keys, num_kv_heads) and value_dim >= 1,
        f"v of shape [{num_keys}, {num_kv_heads}, Dv >= 1] (keys and heads as k)",
        list(v.shape),
    )
    check_head_groups(num_q_heads, num_kv_heads)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), device)
    if cu_seqlens_k is None:
        expect(num_keys == num_tokens, f"{num_tokens} keys (as queries) when cu_seqlens_k is None", num_keys)
        cu_seqlens_k = cu_seqlens_q
    check_tensor("cu_seqlens_k", cu_seqlens_k, 1, (torch.int32,), device)
    expect(
        cu_seqlens_k.shape == cu_seqlens_q.shape,
        f"cu_seqlens_k of shape {list(cu_seqlens_q.shape)}",
        list(cu_seqlens_k.shape),
    )
    q_lens = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, num_tokens)
    k_lens = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, num_keys)
    for name, hint, lens in (("max_seqlen_q", max_seqlen_q, q_lens), ("max_seqlen_k", max_seqlen_k, k_lens)):
        if hint is not None:
            expect(is_int(hint) and hint >= max(lens, default=0), f"{name} >= {max(lens, default=0)}", hint)
    expect(
        isinstance(window_size, (tuple, list)) and len(window_size) == 2,
        "window_size as a (left, right) pair",
        window_size,
    )
    left, right = window_size
    params = call_params(q, scale, causal, sinks, logit_softcap, alibi_slopes, (left, 0 if causal else right))
    out = torch.empty((num_tokens, num_q_heads, value_dim), dtype=q.dtype, device=device)
    lse = new_lse(q) if return_lse else None
    request = call_request("varlen_attention", q, value_dim, params, return_lse)
    impl = select_backend("mm", backend, request)
    metadata = impl.plan_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if not return_lse:
        return impl.varlen_attention(q, k, v, metadata, params, out)
    return impl.varlen_attention(q, k, v, metadata, params, out, lse=lse), lse
