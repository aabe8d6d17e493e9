"""The tensor-parallel group a model's layers are built for: this process's rank, the group's size,
and the two collectives a sharded forward makes (all-reduce of partial sums, all-gather of logits).

Collectives are plain ``torch.distributed`` calls on the group's process group (NCCL on NVIDIA, gloo
on the CPU, XCCL on Intel GPUs: whatever ``torch.distributed`` picks for the device), so that a
captured graph can contain them. A group of size 1 (:data:`SINGLE`) makes no call at all: layers
built for it compute what the unsharded layers compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class TPGroup:
    """``rank`` of ``size`` processes holding one model; ``group`` is their process group (``None``
    for one process). ``cpu_group`` carries the engine's control messages (gloo; the same group when
    ``group`` is gloo already)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"expected 0 <= rank < size with size >= 1, got rank {self.rank} of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"expected a process group for a tensor-parallel group of size {self.size}, got None")

    def split(self, total: int, what: str) -> int:
        """``total / size``; a ``ValueError`` naming ``what`` and both numbers when it does not divide."""
        if total % self.size:
            raise ValueError(f"expected {what} divisible by tensor_parallel_size {self.size}, got {total}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (``x`` itself for one process)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, rank 0's first (``x`` for one process)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()


def tp_or_single(tp: TPGroup | None) -> TPGroup:
    return SINGLE if tp is None else tp


def attention_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(local query heads, local KV heads, first local KV head)`` of this rank.

    Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
    with fewer, each rank keeps the one KV head its query heads use (a KV head is replicated on
    ``size / num_kv_heads`` ranks), which needs ``size`` divisible by ``num_kv_heads``.
    """
    heads = tp.split(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_heads = tp.split(num_kv_heads, "num_key_value_heads")
        return heads, kv_heads, tp.rank * kv_heads
    if tp.size % num_kv_heads:
        raise ValueError(
            f"expected num_key_value_heads dividing tensor_parallel_size {tp.size} (each KV head on "
            f"{tp.size} / num_key_value_heads ranks), got {num_kv_heads}"
        )
    return heads, 1, tp.rank // (tp.size // num_kv_heads)
