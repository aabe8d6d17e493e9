"""The draw of the sampler in one pass over the logits: ``argmax(scores / T - log(-log u))``.

``u`` is the sampler's counter-based uniform variate of (row, token) (``engine/sampler.py``,
``uniform_noise``): the 32-bit hash of the row's two words (``RowWords``, computed from the
request's key and step by the caller) and the token id, 24 bits of it as a float32 in (0, 1). The
kernel computes the same variates in registers instead of reading ``[N, V]`` of them, and reduces
each chunk of ``CHUNK`` tokens of a row to its best score and the first token that has it; the
caller takes the first best chunk. A greedy row (``Greedy[r] != 0``) takes the argmax of its raw
scores. ``DIVIDE``: divide the scores by the row's temperature first (the scores are raw logits);
otherwise they are already scaled (and filtered: -inf never wins unless every token is -inf).

Grid: ``(N, cdiv(V, CHUNK))``; ``BestScore, BestToken [N, num_chunks]``.
"""

import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """The sampler's 32-bit hash round (``sampler._mix32``) on uint32 lanes (products wrap mod 2^32)."""
    x = (x ^ (x >> 16)) * 0x45D9F3B
    x = (x ^ (x >> 16)) * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def gumbel_max_kernel(
    Scores,
    Temperature,
    RowWords,  # [2, N] int64 holding uint32 values: the row's hash words
    Greedy,
    BestScore,
    BestToken,
    vocab,
    stride_row,
    num_rows,
    num_chunks,
    DIVIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    greedy = tl.load(Greedy + row) != 0
    temperature = tl.load(Temperature + row)
    word1 = tl.load(RowWords + row).to(tl.uint32)
    word2 = tl.load(RowWords + num_rows + row).to(tl.uint32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_token = tl.full((BLOCK,), 0, tl.int32)
    start = chunk * CHUNK
    for offset in tl.static_range(0, CHUNK, BLOCK):
        tokens = start + offset + tl.arange(0, BLOCK)
        mask = tokens < vocab
        s = tl.load(Scores + row.to(tl.int64) * stride_row + tokens, mask=mask, other=float("-inf"))
        if DIVIDE:
            s = s / temperature
        h = _mix32(_mix32(word1 ^ _mix32(tokens.to(tl.uint32))) + word2)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noisy = s - tl.log(-tl.log(u))
        score = tl.where(greedy, s, noisy)
        score = tl.where(mask, score, float("-inf"))
        better = score > best  # lanes keep their first best token
        best_token = tl.where(better, tokens, best_token)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    # The first token of the chunk with the best score (an all -inf chunk reports its first token).
    candidates = tl.where(best == top, best_token, 2147483647)
    first = tl.min(candidates, axis=0)
    first = tl.where(top == float("-inf"), start, first)
    tl.store(BestScore + row * num_chunks + chunk, top)
    tl.store(BestToken + row * num_chunks + chunk, first)
