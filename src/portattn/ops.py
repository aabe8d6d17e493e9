"""The functional attention ops: validate, pick a backend, plan, run.

These are public so that other engines can call them with their own page tables. Each call plans
(one host sync) and runs; an engine that runs many layers over one batch should call the backend's
``plan_*`` once and its op method per layer instead.
"""

from __future__ import annotations

import itertools
import math

import torch

from .backends.base import AttentionParams, Request
from .backends.registry import select_backend
from .errors import expect

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when the current index is 0."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.accelerator.current_device_index() if a.type != "cpu" else None
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def _check_tensor(name: str, t: object, dim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    expect(isinstance(t, torch.Tensor), f"{name} to be a torch.Tensor", type(t).__name__)
    expect(t.dim() == dim, f"{name} with {dim} dims", f"shape {tuple(t.shape)}")
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    expect(t.dtype in dtypes, f"{name} of dtype {names}", t.dtype)
    expect(_same_device(t.device, device), f"{name} on {device}", t.device)


def _check_head_groups(num_q_heads: int, num_kv_heads: int) -> None:
    """MHA, GQA and MQA: every KV head serves the same number of query heads."""
    expect(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"query heads divisible by KV heads ({num_kv_heads})",
        num_q_heads,
    )


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> list[int]:
    """Validate offsets and return the per-sequence lengths (host copy)."""
    expect(cu.numel() >= 1, f"{name} of shape [B + 1]", f"shape {tuple(cu.shape)}")
    values = cu.tolist()
    expect(values[0] == 0, f"{name}[0] == 0", values[0])
    lens = [b - a for a, b in itertools.pairwise(values)]
    bad = next((i for i, n in enumerate(lens) if n < 0), None)
    expect(
        bad is None,
        f"non-decreasing {name}",
        f"{name}[{bad}:{bad + 2}] = {values[bad : bad + 2]}" if bad is not None else "",
    )
    expect(values[-1] == total, f"{name}[-1] == {total} (tokens in the input)", values[-1])
    return lens


def _attention_params(
    *,
    head_dim: int,
    num_q_heads: int,
    scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    attention_chunk_size: int | None,
    sinks: torch.Tensor | None,
    logit_softcap: float,
    device: torch.device,
) -> AttentionParams:
    expect(isinstance(window_left, int) and window_left >= -1, "window_left to be an int >= -1", window_left)
    expect(isinstance(window_right, int) and window_right >= -1, "window_right to be an int >= -1", window_right)
    if attention_chunk_size is not None:
        expect(
            isinstance(attention_chunk_size, int) and attention_chunk_size >= 1,
            "attention_chunk_size to be None or a positive int",
            attention_chunk_size,
        )
    expect(logit_softcap >= 0, "logit_softcap >= 0 (0 disables it)", logit_softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    expect(math.isfinite(scale) and scale > 0, "a positive finite scale", scale)
    if sinks is not None:
        _check_tensor("sinks", sinks, 1, _FLOAT_DTYPES, device)
        expect(
            sinks.shape[0] == num_q_heads, f"sinks of shape [{num_q_heads}] (one per query head)", tuple(sinks.shape)
        )
    return AttentionParams(
        scale=float(scale),
        causal=bool(causal),
        window_left=window_left,
        window_right=window_right,
        attention_chunk_size=attention_chunk_size,
        sinks=sinks,
        logit_softcap=float(logit_softcap),
    )


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check_tensor("out", out, len(shape), (like.dtype,), like.device)
    expect(tuple(out.shape) == shape, f"out of shape {list(shape)}", list(out.shape))
    return out


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
) -> torch.Tensor:
    """Attention of new query tokens over a paged KV cache (decode, extend, prefill, mixed).

    Shapes (``T`` query tokens in ``B`` sequences, ``P`` = page size)::

        q            [T, Hq, D]
        k_cache      [num_pages, P, Hkv, D]     Hq % Hkv == 0 (MHA, GQA, MQA)
        v_cache      [num_pages, P, Hkv, Dv]
        page_table   [B, max_pages] int32       page-granular: column p = physical page of
                                                logical page p (see portattn.to_page_table)
        cu_seqlens_q [B + 1] int32              queries of sequence b are q[cu[b]:cu[b+1]]
        seq_lens_k   [B] int32                  keys of sequence b, the new tokens included
        -> out       [T, Hq, Dv]

    The keys of sequence ``b`` are its first ``seq_lens_k[b]`` slots; the new tokens' K/V must
    already be in the cache. Queries are bottom-right aligned: query ``i`` of ``n`` sits at
    position ``L - n + i``. Example with ``P = 2``: a sequence of 5 keys in physical pages 6, 1, 4
    has the row ``[6, 1, 4, <anything>...]``; a decode step is ``n = 1`` at position 4.

    Masks: ``causal`` (key ``j <= p``); ``window_left = W`` (also ``j >= p - W``, -1 = off; a
    Hugging Face ``sliding_window = S`` is ``W = S - 1``); ``attention_chunk_size = C`` (also
    ``j // C == p // C``, absolute positions). ``sinks [Hq]`` adds one logit per head to the
    softmax denominator; ``logit_softcap = c`` maps scores to ``c * tanh(s / c)`` before masking.
    ``scale`` defaults to ``1 / sqrt(D)``. A query that sees no key returns zeros.

    Raises:
        ValueError: inputs of the wrong shape, dtype, device or value (the message says what was
            expected and what came); ``UnsupportedFeatureError`` if ``backend`` lacks a feature.
    """
    _check_tensor("q", q, 3, _FLOAT_DTYPES, q.device if isinstance(q, torch.Tensor) else None)
    device = q.device
    num_tokens, num_q_heads, head_dim = q.shape
    _check_tensor("k_cache", k_cache, 4, (q.dtype,), device)
    _check_tensor("v_cache", v_cache, 4, (q.dtype,), device)
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    value_dim = v_cache.shape[3]
    expect(k_cache.shape[3] == head_dim, f"k_cache head dim {head_dim} (as q)", k_cache.shape[3])
    expect(
        tuple(v_cache.shape[:3]) == (num_pages, page_size, num_kv_heads),
        f"v_cache of shape [{num_pages}, {page_size}, {num_kv_heads}, Dv] (as k_cache)",
        list(v_cache.shape),
    )
    _check_head_groups(num_q_heads, num_kv_heads)
    _check_tensor("page_table", page_table, 2, (torch.int32,), device)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), device)
    _check_tensor("seq_lens_k", seq_lens_k, 1, (torch.int32,), device)
    batch = seq_lens_k.shape[0]
    expect(cu_seqlens_q.shape[0] == batch + 1, f"cu_seqlens_q of shape [{batch + 1}] (B + 1)", list(cu_seqlens_q.shape))
    expect(page_table.shape[0] == batch, f"page_table with {batch} rows (one per sequence)", list(page_table.shape))
    q_lens = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, num_tokens)
    k_lens = seq_lens_k.tolist()
    for b, (n, num_keys) in enumerate(zip(q_lens, k_lens)):
        expect(num_keys >= n, f"seq_lens_k[{b}] >= its query count {n}", num_keys)
    max_keys = max(k_lens, default=0)
    expect(
        page_table.shape[1] * page_size >= max_keys,
        f"page_table with at least {-(-max_keys // page_size)} columns for {max_keys} keys at page size {page_size}",
        page_table.shape[1],
    )
    if batch and max_keys:
        cols = torch.arange(page_table.shape[1], device=device)
        used = cols[None, :] * page_size < seq_lens_k[:, None]
        bad = used & ((page_table < 0) | (page_table >= num_pages))
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"expected page ids in [0, {num_pages}) for used pages, got {int(page_table[row, col])} "
                f"at page_table[{row}, {col}]"
            )
    params = _attention_params(
        head_dim=head_dim,
        num_q_heads=num_q_heads,
        scale=scale,
        causal=causal,
        window_left=window_left,
        window_right=-1,
        attention_chunk_size=attention_chunk_size,
        sinks=sinks,
        logit_softcap=logit_softcap,
        device=device,
    )
    out = _check_out(out, (num_tokens, num_q_heads, value_dim), q)
    request = Request("paged_attention", device.type, q.dtype, head_dim, params.features(head_dim, value_dim))
    impl = select_backend("attention", backend, request)
    metadata = impl.plan_paged(
        cu_seqlens_q,
        seq_lens_k,
        page_table,
        page_size,
        attention_chunk_size=attention_chunk_size,
        num_heads=num_q_heads,
    )
    return impl.paged_attention(q, k_cache, v_cache, metadata, params, out)


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
) -> torch.Tensor:
    """Attention over packed variable-length sequences (vision encoders, dense prefill).

    Shapes::

        q            [Tq, Hq, D]        cu_seqlens_q [B + 1] int32
        k            [Tk, Hkv, D]       cu_seqlens_k [B + 1] int32 (default: cu_seqlens_q)
        v            [Tk, Hkv, Dv]
        -> out       [Tq, Hq, Dv]

    Sequence ``b`` attends only within itself. Queries are bottom-right aligned (query ``i`` of
    ``n`` over ``L`` keys sits at position ``L - n + i``). ``window_size = (left, right)`` follows
    FlashAttention: key ``j`` is visible to position ``p`` iff ``p - left <= j <= p + right``, -1
    meaning unbounded; ``causal`` forces ``right = 0``. ``max_seqlen_*`` are optional hints; when
    given they must be at least the longest sequence. A query that sees no key returns zeros.
    Backend selection uses the ``mm`` kind (``PORTATTN_MM_ATTENTION_BACKEND``).
    """
    _check_tensor("q", q, 3, _FLOAT_DTYPES, q.device if isinstance(q, torch.Tensor) else None)
    device = q.device
    num_tokens, num_q_heads, head_dim = q.shape
    _check_tensor("k", k, 3, (q.dtype,), device)
    _check_tensor("v", v, 3, (q.dtype,), device)
    num_keys, num_kv_heads, value_dim = v.shape
    expect(
        tuple(k.shape) == (num_keys, num_kv_heads, head_dim),
        f"k of shape [{num_keys}, {num_kv_heads}, {head_dim}]",
        list(k.shape),
    )
    _check_head_groups(num_q_heads, num_kv_heads)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), device)
    if cu_seqlens_k is None:
        expect(num_keys == num_tokens, f"{num_tokens} keys (as queries) when cu_seqlens_k is None", num_keys)
        cu_seqlens_k = cu_seqlens_q
    _check_tensor("cu_seqlens_k", cu_seqlens_k, 1, (torch.int32,), device)
    expect(
        cu_seqlens_k.shape == cu_seqlens_q.shape,
        f"cu_seqlens_k of shape {list(cu_seqlens_q.shape)}",
        list(cu_seqlens_k.shape),
    )
    q_lens = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, num_tokens)
    k_lens = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, num_keys)
    for name, hint, lens in (("max_seqlen_q", max_seqlen_q, q_lens), ("max_seqlen_k", max_seqlen_k, k_lens)):
        if hint is not None:
            expect(isinstance(hint, int) and hint >= max(lens, default=0), f"{name} >= {max(lens, default=0)}", hint)
    expect(
        isinstance(window_size, (tuple, list)) and len(window_size) == 2,
        "window_size as a (left, right) pair",
        window_size,
    )
    left, right = window_size
    params = _attention_params(
        head_dim=head_dim,
        num_q_heads=num_q_heads,
        scale=scale,
        causal=causal,
        window_left=left,
        window_right=0 if causal else right,
        attention_chunk_size=None,
        sinks=sinks,
        logit_softcap=logit_softcap,
        device=device,
    )
    out = torch.empty((num_tokens, num_q_heads, value_dim), dtype=q.dtype, device=device)
    request = Request("varlen_attention", device.type, q.dtype, head_dim, params.features(head_dim, value_dim))
    impl = select_backend("mm", backend, request)
    metadata = impl.plan_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return impl.varlen_attention(q, k, v, metadata, params, out)
