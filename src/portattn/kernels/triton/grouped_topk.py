"""DeepSeek V3's grouped top-k routing of one token a program, in one launch where torch's code takes about
fourteen (sigmoid, the bias, each group's top two, the groups' top-k, the mask, the experts' top-k, the
gather, the normalisation and the scaling).

The router's logits ``[T, E]`` (float32) are read as a ``[G, E / G]`` tile a token: scores
``sigmoid(logits)``, choice ``scores + bias``; a group's score is the sum of its two largest choices;
the ``TOPK_GROUP`` best groups stay, and the ``TOP_K`` largest choices among their experts are the
token's experts (largest first; the lowest index among equal values), weighted by their scores,
normalised to sum 1 with ``NORMALIZE`` (``+ 1e-20``, as transformers), times ``SCALING``.
"""

import triton
import triton.language as tl

from .pdl import wait_for_previous


@triton.jit
def _first_max_2d(values, index, BIG: tl.constexpr):
    """The lowest ``index`` among the largest of ``values`` (a 2-D tile)."""
    best = tl.max(tl.max(values, axis=1), axis=0)
    return tl.min(tl.min(tl.where(values == best, index, BIG), axis=1), axis=0)


@triton.jit
def grouped_topk_kernel(
    Logits,
    Bias,
    Weights,
    Ids,
    stride_l,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program ``t``: token ``t``'s ``Weights[t, :TOP_K]`` (float32) and ``Ids[t, :TOP_K]`` (int64).
    ``GROUPS``, ``PER_GROUP`` and ``SLOTS``: powers of two at least ``NUM_GROUPS``, ``NUM_EXPERTS /
    NUM_GROUPS`` and ``TOP_K``."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    per = NUM_EXPERTS // NUM_GROUPS
    groups = tl.arange(0, GROUPS)
    g = groups[:, None]
    j = tl.arange(0, PER_GROUP)[None, :]
    ok = (g < NUM_GROUPS) & (j < per)
    # [GROUPS, PER_GROUP]; the padding's own indices past the experts (g * per + j would repeat them)
    expert = tl.where(ok, g * per + j, NUM_EXPERTS + g * PER_GROUP + j)
    logits = tl.load(Logits + t * stride_l + expert, mask=ok, other=0.0)
    scores = tl.sigmoid(logits)
    choice = tl.where(ok, scores + tl.load(Bias + expert, mask=ok, other=0.0), float("-inf"))
    # a group's score: its two largest choices summed
    first = tl.max(choice, axis=1)  # [GROUPS]
    first_at = tl.min(tl.where(choice == first[:, None], j, PER_GROUP), axis=1)
    second = tl.max(tl.where(j == first_at[:, None], float("-inf"), choice), axis=1)
    group_score = tl.where(groups < NUM_GROUPS, first + second, float("-inf"))
    keep = groups < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_score, axis=0)
        at = tl.min(tl.where(group_score == best, groups, GROUPS), axis=0)
        keep = keep | (groups == at)
        group_score = tl.where(groups == at, float("-inf"), group_score)
    choice = tl.where(keep[:, None], choice, float("-inf"))
    slots = tl.arange(0, SLOTS)
    ids = tl.zeros([SLOTS], dtype=tl.int64)
    weights = tl.zeros([SLOTS], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        at = _first_max_2d(choice, expert, NUM_EXPERTS + GROUPS * PER_GROUP)
        weight = tl.sum(tl.sum(tl.where(expert == at, scores, 0.0), axis=1), axis=0)
        ids = tl.where(slots == i, at.to(tl.int64), ids)
        weights = tl.where(slots == i, weight, weights)
        choice = tl.where(expert == at, float("-inf"), choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(Ids + t * TOP_K + slots, ids, mask=slots < TOP_K)
    tl.store(Weights + t * TOP_K + slots, weights * scaling, mask=slots < TOP_K)
