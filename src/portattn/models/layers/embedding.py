"""Token embeddings and the LM head, vocab-parallel under tensor parallelism.

Both split the vocabulary the same way: rank ``r`` holds rows ``[r * Vp, (r + 1) * Vp)`` of the
``[vocab, hidden]`` table, ``Vp = ceil(vocab / size)`` (the last rank's tail past ``vocab`` is zero
padding), so a tied LM head shares the embedding's shard. The embedding looks up the ids in its
range, zeroes the others and all-reduces (exactly one rank contributes each row); the LM head
computes its ``Vp`` logits and all-gathers them into ``[N, vocab]`` on every rank, for sampling.

Logits are float32 whatever the model's dtype. Where torch has a 16-bit matmul with a float32
output (``torch.mm(..., out_dtype=torch.float32)``, CUDA), the product of 16-bit hidden states and
weights is accumulated and returned in float32: rounding logits of magnitude 16-32 to bf16 moves
them by up to 1/16 and makes near-equal candidates tie; elsewhere the 16-bit product is widened.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed.group import TPGroup, tp_or_single
from .linear import copy_checked, new_parameter, shard_of


class VocabParallel(nn.Module):
    """``weight [Vp, dim]``: this rank's rows ``[vocab_start, vocab_end)`` of the ``[vocab, dim]`` table."""

    def __init__(self, vocab_size: int, dim: int, *, tp: TPGroup | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp_or_single(tp)
        self.vocab_size, self.dim = vocab_size, dim
        self.rows_per_rank = -(-vocab_size // self.tp.size)
        self.vocab_start = min(self.tp.rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = new_parameter(self.rows_per_rank, dim, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:rows], shard_of(loaded, [self.vocab_size, self.dim], 0, self.vocab_start, rows))
        param.data[rows:].zero_()


class Embedding(VocabParallel):
    """``forward(ids [T]) -> [T, embedding_dim]``; ``weight [num_embeddings / size (rounded up), embedding_dim]``."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp: TPGroup | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__(num_embeddings, embedding_dim, tp=tp, dtype=dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, dim]
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))


class LMHead(VocabParallel):
    """Hidden states ``[N, H]`` -> logits ``[N, vocab]`` (gathered from every rank);
    :meth:`tie` shares the embedding's weight (and shard)."""

    def __init__(
        self, hidden_size: int, vocab_size: int, *, tp: TPGroup | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__(vocab_size, hidden_size, tp=tp, dtype=dtype)

    def tie(self, embedding: Embedding) -> None:
        if (embedding.vocab_size, embedding.tp.size) != (self.vocab_size, self.tp.size):
            raise ValueError(
                f"expected an embedding of vocab {self.vocab_size} over {self.tp.size} ranks to tie, "
                f"got vocab {embedding.vocab_size} over {embedding.tp.size}"
            )
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear_float32(x, self.weight)  # [N, Vp] float32
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., : self.vocab_size]  # [N, vocab]


@functools.cache
def has_float32_out_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch multiplies ``dtype`` matrices on ``device`` into a float32 output."""
    try:
        a = torch.ones((1, 8), dtype=dtype, device=device)
        torch.mm(a, a.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as float32: ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``."""
    if x.dtype in (torch.float16, torch.bfloat16) and has_float32_out_mm(x.device, x.dtype):
        out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)  # [M, N]
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight).float()
