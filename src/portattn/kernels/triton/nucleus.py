"""Top-k and top-p (nucleus) sampling without a sort: one program per row, passes over its scores.

The nucleus of a row is every token ``v`` whose likelier tokens hold less than ``top_p`` of the
probability: ``sum_{u: s_u > s_v} p_u < top_p``; a sample from it is a sample of the whole
distribution restricted to it. By rejection (the sampler's reference, ``sampler.nucleus_draw``,
computes the same): round ``r`` draws ``t`` by Gumbel-max among the tokens scoring above ``lo``
(the sampler's counter-based variates, their row words remixed with ``r`` for ``r > 0``), and
accepts it when the mass above ``s_t`` is below ``top_p`` (or ``top_p`` is 1); otherwise no token
scoring at most ``s_t`` is in the nucleus, so ``lo = s_t`` and the next round draws again. Every
accepted token is an exact sample of the nucleus distribution; round 0 draws what the sampler's
plain draw would, so a row with ``top_p`` 1 or whose first draw lands in its nucleus gets that token.
After ``ROUNDS`` rejections (vanishingly rare) the row takes its top token, which is always in the
nucleus. A greedy row takes its argmax. Passes: the maximum and the normaliser (online), then two a
round (the draw, the mass above the drawn token).

``HAS_TOP_K``: rows with ``top_k < V`` keep only the tokens scoring at least their k-th largest score
(ties with it stay, as the sorted filter keeps them), and ``top_p`` applies to that set's mass: the
k-th largest score is found by searching the scores' order-preserving 32-bit keys, 16 pivots a pass
(at most 8 passes, 3 to 6 for k of 20 to 1000 over 128k normal scores; it stops where a pivot has
exactly k tokens at or above it), then one pass sums the set's mass, and the rounds draw only inside
the set. The rejection stays
exact: the target, ``{t in the set: mass above s_t < top_p * mass of the set}``, is still every token
above some score.

``HAS_FLOOR``: rows whose k-th largest score the launcher found already (``torch.topk`` over at
most ``TOP_K_CAP`` scores: far fewer passes than the search) give it as ``Floor [N]`` (raw, divided
here like the scores; -inf: no floor), and ``TopK`` V for them; the set is the tokens at or above it.

``DIVIDE``: divide the scores by the row's temperature first (raw logits); otherwise they are
scaled already (and masked by ``min_p``: -inf). Grid: ``(N,)``; ``Out [N]`` int64.
"""

import triton
import triton.language as tl

from .gumbel_max import _mix32


@triton.jit
def _scores(Scores, row_offset, tokens, mask, temperature, DIVIDE: tl.constexpr):
    s = tl.load(Scores + row_offset + tokens, mask=mask, other=float("-inf"))
    if DIVIDE:
        s = s / temperature
    return s


@triton.jit
def _keys(s):
    """Order-preserving int64 keys of float32 scores: ``a < b`` exactly when ``key(a) < key(b)``."""
    bits = s.to(tl.uint32, bitcast=True)
    flipped = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    return flipped.to(tl.int64)


@triton.jit
def nucleus_kernel(
    Scores,
    Temperature,
    TopP,
    TopK,  # [N] int64: V or more keeps every token (read with HAS_TOP_K only)
    Floor,  # [N] float32: the k-th largest score, -inf for none (read with HAS_FLOOR only)
    RowWords,  # [2, N] int64 holding uint32 values: the row's hash words (round 0)
    Greedy,
    Out,
    vocab,
    stride_row,
    num_rows,
    DIVIDE: tl.constexpr,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
):
    row = tl.program_id(0)
    row_offset = row.to(tl.int64) * stride_row
    greedy = tl.load(Greedy + row) != 0
    temperature = tl.load(Temperature + row)
    top_p = tl.load(TopP + row)
    word1 = tl.load(RowWords + row).to(tl.uint32)
    word2 = tl.load(RowWords + num_rows + row).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)

    # The maximum, the normaliser sum(exp(s - max)) (online, per lane) and the argmax (first index).
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    lane_arg = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, vocab, BLOCK):
        tokens = start + lanes
        mask = tokens < vocab
        s = _scores(Scores, row_offset, tokens, mask, temperature, DIVIDE)
        better = s > lane_max
        new_max = tl.maximum(lane_max, s)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.where(mask, tl.exp(s - safe), 0.0)
        lane_arg = tl.where(better, tokens, lane_arg)
        lane_max = new_max
    top = tl.max(lane_max, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - safe_top)), axis=0)
    argmax = tl.min(tl.where(lane_max == top, lane_arg, 2147483647), axis=0)

    # The top-k set {key >= floor_key} and its mass; without top_k (or k >= V) every token, the total.
    floor_key = tl.zeros((), tl.int64)  # the smallest key: every score is at or above it
    mass = total
    if HAS_FLOOR:
        floor = tl.load(Floor + row)
        if DIVIDE:
            floor = floor / temperature  # the scores' own division: the same order, ties included
        if (floor > float("-inf")) & (greedy == 0):
            floor_key = _keys(floor)
    if HAS_TOP_K:
        k = tl.load(TopK + row)
        if (k < vocab) & (greedy == 0):
            # Search the keys for the k-th largest: count(key >= lo_key) >= k holds and the answer is in
            # [lo_key, hi_key]; each pass counts at 16 pivots across the range and keeps the sixteenth
            # holding it, so 8 passes pin 32 bits (fewer where a pivot has exactly k at or above it).
            lo_key = tl.zeros((), tl.int64)
            hi_key = tl.zeros((), tl.int64) + 4294967295
            found = tl.zeros((), tl.int32)
            js = tl.arange(0, 16).to(tl.int64)
            pivot_lanes = tl.arange(0, BLOCK // 4)
            for _pass in range(8):
                if found == 0:
                    pivots = lo_key + (js * (hi_key - lo_key + 1) + 15) // 16  # [16], the first is lo_key
                    lane_counts = tl.zeros((BLOCK // 4, 16), tl.int32)
                    for start in range(0, vocab, BLOCK // 4):
                        tokens = start + pivot_lanes
                        mask = tokens < vocab
                        s = _scores(Scores, row_offset, tokens, mask, temperature, DIVIDE)
                        at_or_above = (_keys(s)[:, None] >= pivots[None, :]) & mask[:, None]
                        lane_counts += at_or_above.to(tl.int32)
                    counts = tl.sum(lane_counts, axis=0)  # [16], non-increasing
                    chosen = tl.max(tl.where(counts >= k, js, 0), axis=0)  # the last pivot with k or more
                    next_pivot = tl.sum(tl.where(js == chosen + 1, pivots, 0), axis=0)
                    exact = tl.sum(tl.where(js == chosen, counts, 0), axis=0) == k
                    hi_key = tl.where(chosen == 15, hi_key, next_pivot - 1)
                    lo_key = tl.sum(tl.where(js == chosen, pivots, 0), axis=0)
                    if exact | (lo_key == hi_key):  # exactly the k likeliest at or above lo_key
                        found = 1
            floor_key = lo_key
    if HAS_TOP_K or HAS_FLOOR:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if floor_key > 0:
            lane_mass = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, vocab, BLOCK):
                tokens = start + lanes
                mask = tokens < vocab
                s = _scores(Scores, row_offset, tokens, mask, temperature, DIVIDE)
                lane_mass += tl.where(mask & (_keys(s) >= floor_key), tl.exp(s - safe_top), 0.0)
            mass = tl.sum(lane_mass, axis=0)

    token = argmax
    done = greedy.to(tl.int32)
    lo = tl.where(top == top, float("-inf"), float("-inf")).to(tl.float32)  # a scalar tensor, loop-carried
    for r in range(ROUNDS):
        if done == 0:
            w1 = word1
            w2 = word2
            if r > 0:
                round_id = (word1 ^ word1) + r  # r as uint32, compiled (a tensor) or interpreted (an int)
                w1 = _mix32(word1 ^ _mix32(round_id))
                w2 = _mix32(word2 + round_id)
            best = tl.full((BLOCK,), float("-inf"), tl.float32)
            best_token = tl.zeros((BLOCK,), tl.int32)
            best_score = tl.full((BLOCK,), float("-inf"), tl.float32)
            for start in range(0, vocab, BLOCK):
                tokens = start + lanes
                mask = tokens < vocab
                s = _scores(Scores, row_offset, tokens, mask, temperature, DIVIDE)
                h = _mix32(_mix32(w1 ^ _mix32(tokens.to(tl.uint32))) + w2)
                u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                noisy = tl.where(mask & (s > lo) & (_keys(s) >= floor_key), s - tl.log(-tl.log(u)), float("-inf"))
                better = noisy > best
                best_token = tl.where(better, tokens, best_token)
                best_score = tl.where(better, s, best_score)
                best = tl.where(better, noisy, best)
            winner = tl.max(best, axis=0)
            drawn = tl.min(tl.where(best == winner, best_token, 2147483647), axis=0)
            drawn_score = tl.max(tl.where(best_token == drawn, best_score, float("-inf")), axis=0)
            if winner == float("-inf"):  # nothing scores above lo (cannot happen: the top token does)
                drawn = argmax
                drawn_score = top
            above = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, vocab, BLOCK):
                tokens = start + lanes
                mask = tokens < vocab
                s = _scores(Scores, row_offset, tokens, mask, temperature, DIVIDE)
                above += tl.where(mask & (s > drawn_score), tl.exp(s - safe_top), 0.0)
            mass_above = tl.sum(above, axis=0)
            if (top_p >= 1.0) | (mass_above < top_p * mass):
                token = drawn
                done = 1
            else:
                lo = drawn_score
    tl.store(Out + row, token.to(tl.int64))
