"""The greedy token of each row of float32 scores, in two launches that torch's argmax equals.

:func:`argmax_chunks_kernel` reduces each chunk of ``CHUNK`` scores of a row to its best score and the
first token that has it (optionally writing the chunk's scores to a second buffer on the way: the copy
the decode graph makes of its logits); :func:`argmax_merge_kernel` takes the first chunk with the row's
best score. As ``torch.argmax``: the first index of the largest value, a NaN larger than any number
(the first NaN wins), and index 0 for a row of -inf. On an H200 torch's reduction of one 49,152-score
row took 12 us as a graph replay (``scripts/kernels_probe.py small-linears``).

Grids: ``(N, num_chunks)`` then ``(N,)``; ``BestScore, BestToken [N, num_chunks]``.
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous

_NO_INDEX = tl.constexpr(2**31 - 1)  # above every token id


@triton.jit
def argmax_chunks_kernel(
    Scores, Copy, BestScore, BestToken, V, stride_s, stride_c, num_chunks,
    CHUNK: tl.constexpr, COPY: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    wait_for_previous(PDL)
    x = tl.load(Scores + row * stride_s + offs, mask=ok, other=float("-inf"))
    if COPY:
        tl.store(Copy + row * stride_c + offs, x, mask=ok)
    nan = (x != x) & ok
    clean = tl.where(nan, float("-inf"), x)
    best = tl.max(clean, axis=0)
    token = tl.min(tl.where(ok & (clean == best), offs, _NO_INDEX), axis=0)
    first_nan = tl.min(tl.where(nan, offs, _NO_INDEX), axis=0)
    has_nan = first_nan < _NO_INDEX
    tl.store(BestScore + row * num_chunks + chunk, tl.where(has_nan, float("nan"), best))
    tl.store(BestToken + row * num_chunks + chunk, tl.where(has_nan, first_nan, token))


@triton.jit
def argmax_merge_kernel(
    BestScore, BestToken, Out, num_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < num_chunks
    wait_for_previous(PDL)
    score = tl.load(BestScore + row * num_chunks + offs, mask=ok, other=float("-inf"))
    token = tl.load(BestToken + row * num_chunks + offs, mask=ok, other=_NO_INDEX)
    nan = (score != score) & ok
    first_nan = tl.min(tl.where(nan, token, _NO_INDEX), axis=0)
    clean = tl.where(nan, float("-inf"), score)
    best = tl.max(clean, axis=0)
    first_best = tl.min(tl.where(ok & (clean == best), token, _NO_INDEX), axis=0)
    tl.store(Out + row, tl.where(first_nan < _NO_INDEX, first_nan, first_best).to(tl.int64))
