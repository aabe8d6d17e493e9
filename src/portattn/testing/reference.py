"""Dense float64 references and paged fixtures, for portattn's tests and for anyone testing a backend.

The references are deliberately written a different way from the backends: keys are gathered
token by token through slots (``slot = page_table[b, j // P] * P + j % P``), K/V heads are repeated
to the query heads, the mask is a conjunction of one small predicate per rule, and sinks are an
extra softmax column. Fixtures place pages in a random order, fill every slot no sequence owns
with NaN, and point the unused tail of each page-table row at a NaN page, so that a backend that
reads a key it should not shows NaN instead of a plausible number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    causal: bool,
    window_left: int = -1,
    window_right: int = -1,
    chunk: int | None = None,
) -> torch.Tensor:
    """``[n, L]`` mask, one predicate per rule of docs/design.md."""
    p, j = q_pos[:, None], k_pos[None, :]
    ok = torch.ones(p.shape[0], j.shape[1], dtype=torch.bool, device=q_pos.device)
    if causal:
        ok &= j <= p
    elif window_right >= 0:
        ok &= j <= p + window_right
    if window_left >= 0:
        ok &= j >= p - window_left
    if chunk is not None:
        ok &= torch.div(j, chunk, rounding_mode="floor") == torch.div(p, chunk, rounding_mode="floor")
    return ok


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    logit_softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    upcast: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``q [n, Hq, D]`` (bottom-right aligned) over ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]``.

    ``upcast=True`` computes in float64 and returns float64. ``upcast=False`` computes the way a
    good kernel in the inputs' dtype does (float32 accumulation, probabilities rounded to the
    dtype before the value product, output rounded to the dtype): the baseline error that a
    backend's own error is compared with. ``alibi_slopes [Hq]`` add ``-slope * |p - j|``.
    ``return_lse`` also returns ``[n, Hq]``: the log of each softmax denominator (float64, or
    float32 without ``upcast``), the sink's column included.
    """
    n, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    dtype = torch.float64 if upcast else torch.float32
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = num_q_heads // num_kv_heads
    k = k.to(dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.to(dtype).repeat_interleave(group, dim=1)  # [L, Hq, Dv]
    logits = torch.einsum("nhd,lhd->hnl", q.to(dtype) * scale, k)  # [Hq, n, L]
    if logit_softcap > 0:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    q_pos = torch.arange(num_keys - n, num_keys, device=q.device)
    if alibi_slopes is not None:
        distance = torch.cdist(
            q_pos[:, None].to(dtype), torch.arange(num_keys, device=q.device)[:, None].to(dtype), p=1
        )
        logits = logits + torch.einsum("h,nl->hnl", -alibi_slopes.to(dtype), distance)  # [Hq, n, L]
    mask = visible(
        q_pos,
        torch.arange(num_keys, device=q.device),
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        chunk=chunk,
    )
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(dtype).view(num_q_heads, 1, 1).expand(num_q_heads, n, 1)
        logits = torch.cat([logits, sink_col], dim=-1)  # [Hq, n, L + 1]
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)[..., :num_keys]  # fully masked rows -> 0
    if not upcast:
        probs = probs.to(q.dtype).to(dtype)
    out = torch.einsum("hnl,lhd->nhd", probs, v)
    out = out if upcast else out.to(q.dtype)
    return (out, torch.logsumexp(logits, dim=-1).T) if return_lse else out


def _cat_parts(parts: list) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-sequence results (outputs, or (output, lse) pairs) along the tokens."""
    if parts and isinstance(parts[0], tuple):
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.cat(parts)


def gather_sequence(cache: torch.Tensor, page_row: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``cache [N, P, Hkv, D]`` -> the first ``num_keys`` tokens of one sequence, slot by slot."""
    page_size = cache.shape[1]
    j = torch.arange(num_keys, device=cache.device)
    slots = page_row.long()[j // page_size] * page_size + j % page_size
    return cache.flatten(0, 1)[slots]


def paged_attention_ref(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    seq_lens_k,
    *,
    window_left=-1,
    attention_chunk_size=None,
    upcast=True,
    **kwargs,
) -> torch.Tensor:
    """Reference for :func:`portattn.paged_attention` (same arguments, minus ``backend`` / ``out``).

    With ``return_lse=True`` returns ``(out, lse)`` as the op does (see :func:`attention_ref`).
    """
    outs = []
    cu = cu_seqlens_q.tolist()
    for b, num_keys in enumerate(seq_lens_k.tolist()):
        k = gather_sequence(k_cache, page_table[b], num_keys)
        v = gather_sequence(v_cache, page_table[b], num_keys)
        outs.append(
            attention_ref(
                q[cu[b] : cu[b + 1]], k, v, window_left=window_left, chunk=attention_chunk_size, upcast=upcast, **kwargs
            )
        )
    return _cat_parts(outs)


def varlen_attention_ref(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k=None,
    *,
    window_size=(-1, -1),
    causal=False,
    upcast=True,
    max_seqlen_q=None,
    max_seqlen_k=None,
    **kwargs,
) -> torch.Tensor:
    """Reference for :func:`portattn.varlen_attention` (the ``max_seqlen_*`` hints are ignored)."""
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.tolist()
    outs = [
        attention_ref(
            q[cu_q[b] : cu_q[b + 1]],
            k[cu_k[b] : cu_k[b + 1]],
            v[cu_k[b] : cu_k[b + 1]],
            causal=causal,
            window_left=window_size[0],
            window_right=window_size[1],
            upcast=upcast,
            **kwargs,
        )
        for b in range(len(cu_q) - 1)
    ]
    return _cat_parts(outs)


def mla_decode_ref(q_nope, q_rope, kv_cache, page_table, seq_lens, *, scale, upcast=True, return_lse=False):
    """Reference for :func:`portattn.mla_decode`: the absorbed-MLA formula, sequence by sequence.

    Each key's latent row ``[c_kv | k_pe]`` is gathered through its slot; the score is
    ``scale · (q_nope · c_kv + q_rope · k_pe)`` and the value is ``c_kv``. ``upcast`` as in
    :func:`attention_ref` (float64, or the inputs' dtype the way a good kernel computes it);
    ``return_lse`` also returns the log-sum-exp of the scores ``[B, H]`` (-inf without keys).
    """
    dtype = torch.float64 if upcast else torch.float32
    rank = q_nope.shape[2]
    outs, lses = [], []
    for b, num_keys in enumerate(seq_lens.tolist()):
        rows = gather_sequence(kv_cache, page_table[b], num_keys).to(dtype)  # [L, R + Dr]
        c_kv, k_pe = rows[:, :rank], rows[:, rank:]
        logits = scale * (q_nope[b].to(dtype) @ c_kv.T + q_rope[b].to(dtype) @ k_pe.T)  # [H, L]
        probs = torch.softmax(logits, dim=-1) if num_keys else logits  # no key: zeros below
        if not upcast:
            probs = probs.to(q_nope.dtype).to(dtype)
        outs.append(probs @ c_kv)  # [H, R]
        lses.append(torch.logsumexp(logits, dim=-1) if num_keys else logits.new_full(logits.shape[:1], -math.inf))
    out = torch.stack(outs) if outs else q_nope.new_zeros(q_nope.shape, dtype=dtype)
    out = out if upcast else out.to(q_nope.dtype)
    if not return_lse:
        return out
    return out, (torch.stack(lses) if lses else q_nope.new_zeros(q_nope.shape[:2], dtype=dtype))


@dataclass(eq=False)
class PagedCase:
    """Inputs of one :func:`portattn.paged_attention` call, as keyword arguments by ``inputs()``."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    junk_page: int

    def inputs(self) -> dict[str, torch.Tensor]:
        return {
            name: getattr(self, name)
            for name in ("q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "seq_lens_k")
        }


def share_prefix(case: PagedCase, shared_len: int) -> PagedCase:
    """A copy of ``case`` whose sequences share sequence 0's first ``shared_len`` keys, page for page.

    ``shared_len`` is a multiple of the page size and at most every sequence's length. Every row's
    first ``shared_len / P`` page ids become row 0's; the pages they replace are no longer owned
    and are filled with NaN.
    """
    page_size = case.k_cache.shape[1]
    if shared_len % page_size or any(n < shared_len for n in case.seq_lens_k.tolist()):
        raise ValueError(f"expected a multiple of {page_size} no longer than any sequence, got {shared_len}")
    shared = shared_len // page_size
    page_table, k_cache, v_cache = case.page_table.clone(), case.k_cache.clone(), case.v_cache.clone()
    replaced = page_table[1:, :shared].flatten().long()
    k_cache[replaced] = float("nan")
    v_cache[replaced] = float("nan")
    page_table[1:, :shared] = page_table[:1, :shared]
    return PagedCase(case.q, k_cache, v_cache, page_table, case.cu_seqlens_q, case.seq_lens_k, case.junk_page)


def cu_seqlens(lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(lens) + 1]`` int32 offsets."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def make_paged_case(
    q_lens: list[int],
    k_lens: list[int],
    *,
    page_size: int,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    value_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
    extra_columns: int = 2,
) -> PagedCase:
    """A batch of sequences in randomly placed pages, every unowned slot poisoned with NaN.

    Page-table rows have ``extra_columns`` more columns than the longest sequence needs; every
    column past a sequence's last page holds ``junk_page``, a page of NaN. A sequence may have
    more queries than keys (``k_lens`` 0 included).
    """
    value_dim = head_dim if value_dim is None else value_dim
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-L // page_size) for L in k_lens]
    num_pages = sum(pages_per_seq) + spare_pages + 1
    order = torch.randperm(num_pages, generator=gen).tolist()
    junk_page = order.pop()
    width = max(pages_per_seq, default=0) + extra_columns
    page_table = torch.full((len(k_lens), width), junk_page, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full((num_pages, page_size, num_kv_heads, value_dim), float("nan"), dtype=dtype)
    for b, (L, npages) in enumerate(zip(k_lens, pages_per_seq)):
        pages = [order.pop() for _ in range(npages)]
        page_table[b, :npages] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(L, num_kv_heads, value_dim, generator=gen).to(dtype)
        for j in range(npages):
            rows = slice(j * page_size, min((j + 1) * page_size, L))
            k_cache[pages[j], : rows.stop - rows.start] = k[rows]
            v_cache[pages[j], : rows.stop - rows.start] = v[rows]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        page_table=page_table.to(device),
        cu_seqlens_q=cu_seqlens(q_lens, device),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
        junk_page=junk_page,
    )


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference; ``inf`` if ``out`` has NaN/inf or a different shape."""
    if out.shape != ref.shape or not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out.double() - ref.double()).abs().max()) if out.numel() else 0.0


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference of the finite LSEs; ``inf`` if NaN appears or the -inf entries differ."""
    if lse.shape != ref.shape or bool(torch.isnan(lse).any()):
        return math.inf
    if not torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(ref).cpu()):
        return math.inf
    finite = torch.isfinite(ref)
    return float((lse.double() - ref.double())[finite].abs().max()) if bool(finite.any()) else 0.0


def lse_tolerance(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Allowed LSE error: the LSE is accumulated in float32 (float64 for float64 inputs) from scores of
    exactly rounded inputs, so a few dozen units of rounding at the largest magnitude."""
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    finite = ref[torch.isfinite(ref)]
    return 64.0 * eps * max(float(finite.abs().max()) if finite.numel() else 1.0, 1.0)


def tolerance(ref: torch.Tensor, ref_lowp: torch.Tensor, dtype: torch.dtype) -> float:
    """Allowed error: a small multiple of what the reference math itself loses in ``dtype``.

    ``ref`` is the float64 result, ``ref_lowp`` the same reference computed in ``dtype``. The floor
    is one unit of rounding at the output's magnitude for 16-bit types; float32 results differ by
    summation order more than by output rounding, so its floor is a few units (still ~1e-6).
    """
    eps = torch.finfo(dtype).eps
    ulps = 8.0 if dtype == torch.float32 else 1.0
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    return 2.0 * max_error(ref_lowp, ref) + ulps * eps * max(scale, 1.0)
