"""One forward's inputs, built once per step from the scheduler's choice.

The host work of a step is a few numpy operations over per-sequence arrays (no Python loop over
tokens or context), and every integer the step needs goes to the device in one copy from a pinned
buffer (:class:`Staging`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from ..device import is_gpu
from .sequence import Sequence

MODES = ("prefill", "extend", "decode", "mixed")
ALIGN = 16  # elements: each array of an upload starts at a multiple of 128 bytes


class Staging:
    """A pinned host buffer and its device twin, reused every step: :meth:`upload` moves int64 arrays
    to the device in one asynchronous copy and returns device views of them."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pinned = is_gpu(self.device)
        self.event = torch.Event(device=self.device) if self.pinned else None
        self._grow(1 << 12)

    def _grow(self, size: int) -> None:
        # Plain tensors even when a step (under inference mode) grows them: a plan made outside
        # inference mode may write them too.
        with torch.inference_mode(False):
            self.host = torch.empty(size, dtype=torch.int64, pin_memory=self.pinned)
            self.dev = torch.empty(size, dtype=torch.int64, device=self.device)
        self.host_np = self.host.numpy()

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device int64 copies of ``arrays`` (views of one buffer, valid until the next upload). Each
        starts at a multiple of :data:`ALIGN` elements: a kernel that takes a view is compiled for an
        aligned address whatever the step's sizes (Triton specializes pointers on 16-byte alignment,
        and a view at an odd offset would be a variant of its own, compiled when a step first makes
        one)."""
        sizes = [a.shape[0] for a in arrays]
        starts = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([-(-n // ALIGN) * ALIGN for n in sizes], out=starts[1:])
        total = int(starts[-1])
        if self.event is not None:
            self.event.synchronize()  # the previous upload has left the pinned buffer
        if total > self.host.shape[0]:
            self._grow(1 << (total - 1).bit_length())
        for a, start in zip(arrays, starts.tolist()):
            self.host_np[start : start + a.shape[0]] = a
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        if self.event is not None:
            self.event.record()
        return [self.dev[start : start + n] for start, n in zip(starts.tolist(), sizes)]


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """The ``T`` new tokens of ``B`` sequences (what ``AttentionBackend.plan`` reads).

    ``mode``: ``prefill`` (no sequence has cached tokens), ``decode`` (one new token each),
    ``extend`` (new tokens after cached ones), ``mixed`` (decodes and prefills/extends together).
    ``q_lens`` / ``k_lens``: host copies of the lengths (the plan reads these, not the device).
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
    q_lens: tuple[int, ...] | None = None
    k_lens: tuple[int, ...] | None = None

    @classmethod
    def build(
        cls,
        scheduled: list[tuple[Sequence, int]],
        req_to_token: torch.Tensor,
        page_size: int,
        attention_chunk_size: int | None = None,
        staging: Staging | None = None,
        fed: Collection[Sequence] = (),
    ) -> ForwardBatch:
        """``fed``: sequences whose one new token a launched step is sampling (not in their
        ``token_ids``; ``num_computed == num_tokens``): its position is ``num_tokens`` and its input id
        0 here, which the caller replaces on the device (``ModelRunner.plan``'s feed)."""
        staging = staging if staging is not None else Staging(req_to_token.device)
        starts = np.fromiter((seq.num_computed for seq, _ in scheduled), np.int64, len(scheduled))  # [B]
        q_lens = np.fromiter((n for _, n in scheduled), np.int64, len(scheduled))  # [B]
        rows = np.fromiter((seq.req_pool_idx for seq, _ in scheduled), np.int64, len(scheduled))  # [B]
        k_lens = starts + q_lens
        cu = np.zeros(len(scheduled) + 1, np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        if fed:
            input_ids = np.zeros(num_tokens, np.int64)
            for (seq, n), start, offset in zip(scheduled, starts.tolist(), cu.tolist()):
                if seq in fed:
                    if n != 1 or start != seq.num_tokens:
                        raise ValueError(f"expected a fed sequence to decode its token in flight, got {n} tokens "
                                         f"from position {start} of {seq.num_tokens}")  # fmt: skip
                else:
                    input_ids[offset : offset + n] = seq.token_ids[start : start + n]
        elif num_tokens == len(scheduled):  # one token each: no slices
            input_ids = np.fromiter((seq.token_ids[seq.num_computed] for seq, _ in scheduled), np.int64, num_tokens)
        else:
            input_ids = np.empty(num_tokens, np.int64)
            for (seq, n), start, offset in zip(scheduled, starts.tolist(), cu.tolist()):
                input_ids[offset : offset + n] = seq.token_ids[start : start + n]
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)  # [T]
        token_rows = np.repeat(rows, q_lens)  # [T]

        decodes = int(np.count_nonzero((q_lens == 1) & (k_lens > 1)))
        if decodes == len(scheduled):
            mode = "decode"
        elif decodes:
            mode = "mixed"
        else:
            mode = "prefill" if bool((q_lens == k_lens).all()) else "extend"
        ids_t, positions_t, token_rows_t, cu_t, k_lens_t, rows_t = staging.upload(
            [input_ids, positions, token_rows, cu, k_lens, rows]
        )
        q_list, k_list = q_lens.tolist(), k_lens.tolist()
        return cls(
            mode=mode,
            input_ids=ids_t,
            positions=positions_t,
            cu_seqlens_q=cu_t.int(),
            seq_lens_k=k_lens_t.int(),
            req_pool_indices=rows_t,
            req_to_token=req_to_token,
            out_cache_loc=req_to_token[token_rows_t, positions_t].long(),  # [T]
            page_size=page_size,
            max_seqlen_k=max(k_list),
            attention_chunk_size=attention_chunk_size,
            q_lens=tuple(q_list),
            k_lens=tuple(k_list),
        )
