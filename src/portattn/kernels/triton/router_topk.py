"""A router of sigmoid-scored experts (Llama 4's) for a few tokens in one launch, where torch's code takes six
(the logits' matrix product and its split-K reduction, the top-k, two conversions and the sigmoid).

Program ``(t, s)`` reads features ``[s · SPLIT_K, (s + 1) · SPLIT_K)`` of token ``t``'s row of ``X [T, K]`` and of
the router's weight ``W [E, K]`` in ``[BLOCK_E, BLOCK_K]`` tiles and stores each expert's float32 partial sum in
``Partials [T, S, BLOCK_E]``. It then counts itself done on the token's counter (an atomic add); the token's last
program sums the partials in split order, rounds the logits to ``X``'s dtype (as ``F.linear`` rounds its output),
takes the ``TOP_K`` largest (largest first, the lowest index among equal logits) and their scores
``sigmoid(logit)`` in float32, rounded to ``X``'s dtype, and sets the counter back to zero. Splitting the
features keeps the weight's read spread over programs (one program a token reading all of it took 20 us for
Llama 4 Scout's 16 x 5120 on an H200).
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous


@triton.jit
def router_topk_kernel(
    X,
    W,
    Partials,
    Counters,
    Scores,
    Ids,
    K,
    stride_x,
    stride_w,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``Scores[t, :TOP_K]`` (``X``'s dtype) and ``Ids[t, :TOP_K]`` (int64) of token ``t``; ``Counters [T]`` int32
    zeros (left zeros). ``BLOCK_E`` and ``SLOTS``: powers of two at least ``NUM_EXPERTS`` and ``TOP_K``;
    ``SPLIT_K`` a multiple of ``BLOCK_K``; ``BLOCK_S`` a power of two at least ``NUM_SPLITS``. The first weight tile is loaded before the kernel waits for the one
    before it (the weight is no earlier kernel's output)."""
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < NUM_EXPERTS
    rows = experts.to(tl.int64)[:, None] * stride_w
    first = split * SPLIT_K
    ks = first + tl.arange(0, BLOCK_K)
    w = tl.load(W + rows + ks[None, :], mask=e_ok[:, None] & (ks < K)[None, :], other=0.0)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, SPLIT_K, BLOCK_K):
        ks = first + k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        if k0 > 0:
            w = tl.load(W + rows + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + t * stride_x + ks, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(Partials + (t * NUM_SPLITS + split) * BLOCK_E + experts, tl.sum(acc, axis=1))
    tl.debug_barrier()  # every thread's partial stored before the count
    done = tl.atomic_add(Counters + t, 1, sem="acq_rel")
    if done == NUM_SPLITS - 1:  # the token's last program: its partials are all stored
        splits = tl.arange(0, BLOCK_S)
        parts = tl.load(
            Partials + (t * NUM_SPLITS + splits[:, None]) * BLOCK_E + experts[None, :],
            mask=(splits < NUM_SPLITS)[:, None],
            other=0.0,
            cache_modifier=".cg",
        )  # [BLOCK_S, BLOCK_E]
        dtype = X.dtype.element_ty
        logits = tl.where(e_ok, tl.sum(parts, axis=0).to(dtype).to(tl.float32), float("-inf"))  # [BLOCK_E]
        slots = tl.arange(0, SLOTS)
        ids = tl.zeros([SLOTS], dtype=tl.int64)
        scores = tl.zeros([SLOTS], dtype=tl.float32)
        for i in tl.static_range(TOP_K):
            best = tl.max(logits, axis=0)
            at = tl.min(tl.where(logits == best, experts, BLOCK_E), axis=0)
            ids = tl.where(slots == i, at.to(tl.int64), ids)
            scores = tl.where(slots == i, tl.sigmoid(best), scores)
            logits = tl.where(experts == at, float("-inf"), logits)
        tl.store(Ids + t * TOP_K + slots, ids, mask=slots < TOP_K)
        tl.store(Scores + t * TOP_K + slots, scores.to(dtype), mask=slots < TOP_K)
        tl.store(Counters + t, 0)
