"""How much work a case is: visible (query, key) pairs, FLOPs and the fewest bytes it must move.

Masks are accounted exactly: a pair counts only if the key is visible to the query under the
case's causal / window / chunk rule (``masks.key_range``), and a key's bytes count once if any
query of its sequence sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import key_range, query_positions


@dataclass(frozen=True)
class Work:
    flops: float  # 2 * pairs * Hq * (D + Dv)
    bytes: float  # Q read + O written + every visible K/V row read once (in the cache's dtype) + page table


def count_work(
    q_lens: list[int],
    k_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    value_dim: int,
    element_size: int,
    kv_element_size: int | None = None,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    chunk: int | None = None,
    page_table_bytes: int = 0,
) -> Work:
    pairs = 0
    keys_read = 0
    for n, num_keys in zip(q_lens, k_lens):
        pos = query_positions(n, num_keys)
        lo, hi = key_range(pos, causal=causal, window_left=window_left, window_right=window_right, chunk=chunk)
        lo, hi = lo.clamp(min=0), hi.clamp(max=num_keys - 1)
        pairs += int((hi - lo + 1).clamp(min=0).sum())
        seen = torch.zeros(num_keys + 1, dtype=torch.int32)  # difference array of the visible ranges
        ok = hi >= lo
        seen.index_add_(0, lo[ok], torch.ones_like(lo[ok], dtype=torch.int32))
        seen.index_add_(0, hi[ok] + 1, -torch.ones_like(hi[ok], dtype=torch.int32))
        keys_read += int((seen.cumsum(0)[:num_keys] > 0).sum())
    tokens = sum(q_lens)
    flops = 2.0 * pairs * num_q_heads * (head_dim + value_dim)
    kv_size = element_size if kv_element_size is None else kv_element_size  # fp8 caches: 1 byte
    nbytes = kv_size * keys_read * num_kv_heads * (head_dim + value_dim)
    nbytes += element_size * tokens * num_q_heads * (head_dim + value_dim)
    return Work(flops=flops, bytes=float(nbytes + page_table_bytes))
