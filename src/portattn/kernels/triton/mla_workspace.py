"""Split-KV arithmetic of the MLA decode kernels: the split count, the workspace size and its layout.

The Triton MLA decode kernel (``mla_decode.py`` beside this file) writes one float32 partial output
``[B, H, S, R]`` and one float32 log-sum-exp ``[B, H, S]`` per split into a caller's workspace and
merges them (the seesaw kernel over an fp8 cache writes its partial outputs in bfloat16 into the first half
of the same bytes, ``mla_decode_seesaw_fp8.bf16_partials``). This module owns that layout and imports no
Triton, so that any caller (the engine's plan step, a graph-capturing runner, another backend) can size a
workspace on any machine.

The split count is a pure function of the problem (:func:`choose_num_kv_splits`); no device property
enters it: a workspace sized on one machine fits the same call on any other.
"""

from __future__ import annotations

import torch

from ...errors import check_int

# Programs (head block x split x sequence) one launch aims at. Blocks of 64 heads (8 warps, bound by their
# tensor-core work) run best at about one per compute unit, blocks of 16-32 heads (4 warps) at about two: on an
# H200 (132 SMs), DeepSeek-V3's 128 heads over 1024-4096 keys at 1-64 sequences ran fastest at 128 programs
# (one sequence over 1024 keys: 94 us unsplit, 16 us in 32 splits; 64 sequences: 98 us unsplit, 119 in 2), and
# 16 heads at 128-256 (benchmarks/results/round21_h200/NOTES.md).
TARGET_PROGRAMS = 128
TARGET_PROGRAMS_FEW_HEADS = 256  # heads < HEADS_PER_PROGRAM: one program holds them all, in a smaller block
HEADS_PER_PROGRAM = 64  # query heads one program covers at most (for counting programs only)
MAX_KV_SPLITS = 64
# Keys of a split at least: two 32-key steps. A split's partial output (4·kv_lora_rank bytes a head, written and
# read back by the merge) outweighs the latent rows it reads at so few keys, but the partials of a small batch
# stay in the L2 and their traffic cost less than the parallelism gained (measured as above). The kernel cuts
# splits of at least this many keys under any split count (mla_decode.py), so that a sequence is cut alike
# whether the count was chosen for its own length or for a longer one (a captured graph's).
MIN_SPLIT_TOKENS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_num_kv_splits(
    max_seqlen_k: int, batch_size: int, num_heads: int, *, num_kv_splits: int | None = None
) -> int:
    """Split count for a decode batch, from the problem alone.

    Without splits a batch offers ``batch_size · ceil(num_heads / 64)`` programs; splits are added
    until there are about ``TARGET_PROGRAMS`` of them (``TARGET_PROGRAMS_FEW_HEADS`` under 64 heads),
    but no more than the longest sequence fills with ``MIN_SPLIT_TOKENS`` keys a split (the kernel's
    floor), and never more than ``MAX_KV_SPLITS``. Always at least 1. ``num_kv_splits`` ``None`` or -1
    chooses so; a positive int is that count.
    """
    if num_kv_splits is not None and num_kv_splits != -1:
        check_int("num_kv_splits", num_kv_splits, 1)
        return num_kv_splits
    heads = max(1, num_heads)
    programs = max(1, batch_size) * _cdiv(heads, HEADS_PER_PROGRAM)
    target = TARGET_PROGRAMS if heads >= HEADS_PER_PROGRAM else TARGET_PROGRAMS_FEW_HEADS
    wanted = _cdiv(target, programs)
    return max(1, min(wanted, _cdiv(max_seqlen_k, MIN_SPLIT_TOKENS), MAX_KV_SPLITS))


def mla_workspace_size(
    max_seq_len: int,
    batch_size: int,
    num_heads: int,
    page_size: int,
    *,
    num_kv_splits: int = -1,
    kv_lora_rank: int = 512,
) -> int:
    """Bytes of workspace that :func:`mla_decode` needs for a batch of this shape.

    A pure function of its arguments: ``S = num_kv_splits`` (or, for ``-1``,
    ``choose_num_kv_splits(max_seq_len, batch_size, num_heads)``, the split count ``mla_decode``
    then uses), and the size is ``4 · batch_size · num_heads · S · (kv_lora_rank + 1)`` -- one
    float32 partial output and one float32 log-sum-exp per (sequence, head, split) -- or 0 when
    ``S == 1`` (the kernel then writes the output directly).

    ``max_seq_len`` is the longest sequence of the calls the workspace serves (any upper bound
    works: the size never shrinks as it grows). ``page_size`` is checked but does not change the
    size: splits are cut in tokens, so every page size needs the same workspace.

    Allocate it as ``torch.empty(size, dtype=torch.uint8, device=...)``; its contents need no
    initialisation and are scratch after the call.
    """
    check_int("max_seq_len", max_seq_len, 0)
    check_int("batch_size", batch_size, 0)
    check_int("num_heads", num_heads, 1)
    check_int("page_size", page_size, 1)
    check_int("kv_lora_rank", kv_lora_rank, 1)
    splits = choose_num_kv_splits(max_seq_len, batch_size, num_heads, num_kv_splits=num_kv_splits)
    if splits == 1:
        return 0
    return 4 * batch_size * num_heads * splits * (kv_lora_rank + 1)


def partial_buffers(
    workspace: torch.Tensor, batch_size: int, num_heads: int, num_kv_splits: int, kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the workspace: partial outputs ``[B, H, S, R]`` and log-sum-exps ``[B, H, S]``, float32."""
    rows = batch_size * num_heads * num_kv_splits
    floats = workspace[: 4 * rows * (kv_lora_rank + 1)].view(torch.float32)
    part_out = floats[: rows * kv_lora_rank].view(batch_size, num_heads, num_kv_splits, kv_lora_rank)
    part_lse = floats[rows * kv_lora_rank :].view(batch_size, num_heads, num_kv_splits)
    return part_out, part_lse
