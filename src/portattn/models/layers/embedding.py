"""Token embeddings and the LM head (a linear over the hidden states, optionally tied to the embeddings)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear, copy_checked, new_parameter


class Embedding(nn.Module):
    """``weight [num_embeddings, embedding_dim]``; ``forward(ids [T]) -> [T, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = new_parameter(num_embeddings, embedding_dim, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(Linear):
    """Hidden states ``[N, H]`` -> logits ``[N, vocab]``; :meth:`tie` shares the embedding's weight."""

    def __init__(self, hidden_size: int, vocab_size: int, *, dtype: torch.dtype | None = None):
        super().__init__(hidden_size, vocab_size, bias=False, dtype=dtype)

    def tie(self, embedding: Embedding) -> None:
        self.weight = embedding.weight
