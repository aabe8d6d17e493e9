"""DeepSeek-style Multi-head Latent Attention (MLA) decode: split choice, workspace, latent cache, op.

The latent cache keeps one row per token, ``[c_kv | k_pe]`` (``kv_lora_rank + rope_dim`` wide),
shared by all query heads. Absorbed decode attends each head's ``[q_nope | q_rope]`` to those rows
(score = scale·(q_nope·c_kv + q_rope·k_pe)) and returns a weighted sum of ``c_kv``.

Split-KV: each sequence's keys are cut into ``num_kv_splits`` contiguous ranges attended in
parallel; every range leaves a partial output and its log-sum-exp in a workspace, and a merge step
combines them. The split count, and so the workspace size, is a pure function of the problem; the
arithmetic lives beside the kernel that owns the layout (``kernels/triton/mla_workspace.py``,
importable without Triton) and is re-exported here.
"""

from __future__ import annotations

import math

import torch

from .backends.base import MLARequest
from .backends.metadata import MLADecodeMetadata
from .backends.registry import select_backend
from .errors import expect, is_real
from .kernels.triton.mla_workspace import MIN_SPLIT_TOKENS, choose_num_kv_splits, mla_workspace_size, partial_buffers
from .kv_quant import FP8_DTYPES, check_scale
from .validation import FLOAT_DTYPES, check_page_table, check_sizes, check_tensor


def split_latent(kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(c_kv [N, P, R], k_pe [N, P, rope_dim])`` of a latent cache ``[N, P, R + rope_dim]``."""
    return kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:]


def plan_mla_decode(
    page_table: torch.Tensor,
    seq_lens_k: torch.Tensor,
    page_size: int,
    *,
    num_heads: int,
    kv_lora_rank: int,
    max_seqlen_k: int | None = None,
    num_kv_splits: int | None = None,
    workspace: torch.Tensor | None = None,
) -> MLADecodeMetadata:
    """Once per forward: choose the split count and provide the workspace.

    ``max_seqlen_k`` is a host int bounding ``seq_lens_k`` (an engine knows it); when omitted it is
    the page table's capacity ``max_pages · page_size``, so planning never syncs with the device.
    A given ``workspace`` must hold ``mla_workspace_size(max_seqlen_k, B, num_heads, page_size,
    num_kv_splits=..., kv_lora_rank=...)`` bytes; otherwise one is allocated. Its partial-result
    views are cut here, once, so that the per-layer launches only pass them on.
    """
    batch = seq_lens_k.shape[0]
    if max_seqlen_k is None:
        max_seqlen_k = page_table.shape[1] * page_size
    splits = choose_num_kv_splits(max_seqlen_k, batch, num_heads, num_kv_splits=num_kv_splits)
    needed = mla_workspace_size(
        max_seqlen_k, batch, num_heads, page_size, num_kv_splits=splits, kv_lora_rank=kv_lora_rank
    )
    if workspace is not None:
        check_tensor("workspace", workspace, 1, (torch.uint8,), seq_lens_k.device)
        expect(workspace.is_contiguous(), "a contiguous workspace", f"strides {workspace.stride()}")
        expect(workspace.data_ptr() % 16 == 0, "workspace aligned to 16 bytes", f"address {workspace.data_ptr()}")
        expect(
            workspace.numel() >= needed,
            f"a workspace of at least {needed} bytes (mla_workspace_size for {splits} splits)",
            f"{workspace.numel()} bytes",
        )
    elif needed:
        workspace = torch.empty(needed, dtype=torch.uint8, device=seq_lens_k.device)
    workspace = workspace if needed else None
    return MLADecodeMetadata(
        page_table=page_table,
        seq_lens_k=seq_lens_k,
        page_size=page_size,
        max_seqlen_k=max_seqlen_k,
        num_kv_splits=splits,
        workspace=workspace,
        workspace_bytes=needed,
        partials=None if workspace is None else partial_buffers(workspace, batch, num_heads, splits, kv_lora_rank),
        min_split_keys=MIN_SPLIT_TOKENS if num_kv_splits in (None, -1) else 1,
        splits_chosen=num_kv_splits in (None, -1),
    )


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_kv_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    kv_scale: float = 1.0,
    check: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA decode: one query per sequence over its paged latent cache (absorbed form).

    Shapes (``B`` sequences, ``H`` query heads, ``R = kv_lora_rank``, ``Dr = rope_dim``,
    ``P`` = page size)::

        q_nope      [B, H, R]
        q_rope      [B, H, Dr]
        kv_cache    [num_pages, P, R + Dr]     row = [c_kv | k_pe], one latent head; dtype of
                                               q_nope, or float8_e4m3fn / float8_e5m2
        page_table  [B, max_pages] int32       page-granular: column p = physical page of
                                               logical page p (see portattn.to_page_table)
        seq_lens    [B] int32                  keys of sequence b (the current token included)
        -> out      [B, H, R]                  dtype of q_nope
        -> lse      [B, H] float32             with return_lse=True (float64 for float64 inputs)

    For each sequence ``b`` and head ``h``, over its keys ``j < seq_lens[b]``::

        s_j = scale · (q_nope[b, h] · c_kv_j + q_rope[b, h] · k_pe_j)
        out[b, h] = Σ_j softmax(s)_j · c_kv_j

    Key ``j`` lives in slot ``page_table[b, j // P] · P + j % P``. Example with ``P = 2``: a
    sequence of 3 keys in physical pages 5 and 0 has the row ``[5, 0, <anything>...]``. Slots past
    ``seq_lens[b]`` and page-table columns past its last page are never read. A sequence with
    ``seq_lens[b] == 0`` returns zeros (a batch where every sequence is empty too, with a 0-page
    cache or a 0-column page table). Any page size, rank, rope dim and head count.

    ``page_table`` must be page-granular: token-granular ``req_to_token`` rows run without error
    when their slot numbers happen to be valid page ids, and read the wrong pages. Build it with
    ``portattn.to_page_table`` (a ``PageTable``, whose page size is checked against
    ``kv_cache``); ``check=True`` (default: ``PORTATTN_DEBUG``) checks a raw table fully, as
    ``paged_attention`` does.

    ``num_kv_splits``: ``None`` (or -1) chooses from the problem with
    :func:`choose_num_kv_splits` (``max_seqlen_k`` = the longest sequence), each split then holding at
    least ``MIN_SPLIT_TOKENS`` (64) keys, so that plans for other bounds of the same sequences cut them
    alike and give the same bits; a positive int forces that many (cut at the kernel's key tile).
    Results agree across split counts within rounding. ``workspace``: optional uint8
    tensor of at least ``mla_workspace_size(max(seq_lens), B, H, P, num_kv_splits=...,
    kv_lora_rank=R)`` bytes (allocated per call when omitted; pass one to reuse it, e.g. under a
    captured graph). Backends that need no workspace (``torch``) ignore it.

    ``return_lse=True`` returns ``(out, lse)`` with ``lse[b, h] = log Σ_j exp(s_j)`` (natural log;
    -inf for a sequence without keys), so that decodes over parts of a sequence's keys merge with
    :func:`portattn.merge_attention_states`.

    An fp8 latent cache holds rows divided by ``kv_scale`` (one positive float per layer, for
    ``c_kv`` and ``k_pe`` alike; the backend's ``write_latent`` stores them saturated): the formula above
    reads ``kv_scale * row``. Queries and the output stay in ``q_nope``'s dtype; with a cache in
    that dtype ``kv_scale`` must be 1.0.

    Raises:
        ValueError: inputs of the wrong shape, dtype, device or value ("expected ..., got ...");
            ``UnsupportedFeatureError`` if ``backend`` lacks MLA decode or the cache dtype.
    """
    check_tensor("q_nope", q_nope, 3, FLOAT_DTYPES, q_nope.device if isinstance(q_nope, torch.Tensor) else None)
    device, dtype = q_nope.device, q_nope.dtype
    batch, num_heads, rank = q_nope.shape
    expect(num_heads >= 1 and rank >= 1, "q_nope of shape [B, H >= 1, kv_lora_rank >= 1]", list(q_nope.shape))
    check_tensor("q_rope", q_rope, 3, (dtype,), device)
    rope_dim = q_rope.shape[2]
    expect(
        tuple(q_rope.shape[:2]) == (batch, num_heads),
        f"q_rope of shape [{batch}, {num_heads}, rope_dim] (as q_nope)",
        list(q_rope.shape),
    )
    check_tensor("kv_cache", kv_cache, 3, (dtype, *FP8_DTYPES), device)
    quantized = kv_cache.dtype != dtype
    kv_scale = check_scale("kv_scale", kv_scale)
    expect(quantized or kv_scale == 1.0, f"kv_scale 1.0 with a {dtype} cache", kv_scale)
    num_pages, page_size, row = kv_cache.shape
    check_sizes({"page size (kv_cache.shape[1])": page_size})
    expect(
        row == rank + rope_dim,
        f"kv_cache rows of kv_lora_rank + rope_dim = {rank} + {rope_dim} = {rank + rope_dim}",
        row,
    )
    check_tensor("page_table", page_table, 2, (torch.int32,), device)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), device)
    expect(seq_lens.shape[0] == batch, f"seq_lens of shape [{batch}] (one per sequence)", list(seq_lens.shape))
    expect(page_table.shape[0] == batch, f"page_table with {batch} rows (one per sequence)", list(page_table.shape))
    expect(is_real(scale) and math.isfinite(scale) and scale > 0, "a positive finite scale", scale)
    lens = seq_lens.tolist()
    bad = next((b for b, n in enumerate(lens) if n < 0), None)
    expect(bad is None, "seq_lens >= 0", f"seq_lens[{bad}] = {lens[bad]}" if bad is not None else "")
    max_seqlen_k = max(lens, default=0)
    check_page_table(page_table, lens, seq_lens, page_size, num_pages, check=check)
    features = frozenset({"lse"}) if return_lse else frozenset()
    request = MLARequest(
        "mla_decode", device.type, dtype, rank + rope_dim, features, kv_dtype=kv_cache.dtype if quantized else None
    )
    impl = select_backend("attention", backend, request)
    metadata = plan_mla_decode(
        page_table,
        seq_lens,
        page_size,
        num_heads=num_heads,
        kv_lora_rank=rank,
        max_seqlen_k=max_seqlen_k,
        num_kv_splits=num_kv_splits,
        workspace=workspace,
    )
    out = torch.empty((batch, num_heads, rank), dtype=dtype, device=device)
    scales = {"kv_scale": kv_scale} if quantized else {}  # backends without fp8 keep the old signature
    if not return_lse:
        return impl.mla_decode(q_nope, q_rope, kv_cache, metadata, float(scale), out, **scales)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.empty((batch, num_heads), dtype=lse_dtype, device=device)
    return impl.mla_decode(q_nope, q_rope, kv_cache, metadata, float(scale), out, lse, **scales), lse
