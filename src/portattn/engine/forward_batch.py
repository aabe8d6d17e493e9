"""One forward's inputs, built once per step from the scheduler's choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence

MODES = ("prefill", "extend", "decode", "mixed")


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """The ``T`` new tokens of ``B`` sequences (what ``AttentionBackend.plan`` reads).

    ``mode``: ``prefill`` (no sequence has cached tokens), ``decode`` (one new token each),
    ``extend`` (new tokens after cached ones), ``mixed`` (decodes and prefills/extends together).
    """

    mode: str
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_k: torch.Tensor  # [B] int32, new tokens included
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32, token-granular
    out_cache_loc: torch.Tensor  # [T] int64 slots the new K/V go to
    page_size: int
    max_seqlen_k: int
    attention_chunk_size: int | None = None

    @classmethod
    def build(
        cls,
        scheduled: list[tuple[Sequence, int]],
        req_to_token: torch.Tensor,
        page_size: int,
        attention_chunk_size: int | None = None,
    ) -> ForwardBatch:
        device = req_to_token.device
        input_ids, positions, rows, q_lens, k_lens = [], [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            rows += [seq.req_pool_idx] * n
            q_lens.append(n)
            k_lens.append(start + n)
        decodes = sum(n == 1 and k > 1 for n, k in zip(q_lens, k_lens))
        if decodes == len(q_lens):
            mode = "decode"
        elif decodes:
            mode = "mixed"
        else:
            mode = "prefill" if all(n == k for n, k in zip(q_lens, k_lens)) else "extend"
        positions_t = torch.tensor(positions, dtype=torch.int64)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=cu[1:])
        rows_t = torch.tensor(rows, dtype=torch.int64).to(device)
        positions_t = positions_t.to(device)
        return cls(
            mode=mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
            positions=positions_t,
            cu_seqlens_q=cu.to(device),
            seq_lens_k=torch.tensor(k_lens, dtype=torch.int32).to(device),
            req_pool_indices=torch.tensor([seq.req_pool_idx for seq, _ in scheduled], dtype=torch.int64).to(device),
            req_to_token=req_to_token,
            out_cache_loc=req_to_token[rows_t, positions_t].long(),  # [T]
            page_size=page_size,
            max_seqlen_k=max(k_lens),
            attention_chunk_size=attention_chunk_size,
        )
