"""When a step attends through a cascade: the engine's rule for batches that share a prefix.

Sequences that share a prompt prefix share its KV-cache pages (prefix caching; the ``n`` samples of
one request; many requests with one system prompt). Plain paged attention reads those pages once per
sequence; a cascade (:mod:`portattn.cascade`) reads them once for the whole batch, attends each
sequence's own keys apart and merges the two states. It pays where attention is bound by reading
keys, and costs a second pass and a merge per layer, launched from the host:

- the op alone, on the H200 (bf16, 32 query / 8 KV heads of 128): 64 decodes over 8,192 shared keys
  and 256 of their own ran 2.06x faster as a cascade; 64 extends of 256 new tokens each over the
  same prefix ran at 0.88x (long query runs are bound by compute, which sharing does not reduce);
- in the engine (``python -m benchmarks.engine --parts cascade``, Llama-3-8B shape, H200), run
  eagerly: at batches 8-64 over 1,024 or 8,192 shared tokens an eager cascade step ran at 0.21-0.75x
  the speed of the captured graph step it would replace (26-42 ms against 6-22 ms), and slower than
  the eager plain step too (eager steps of this engine are bound by the host's launches, about 0.7 ms
  a layer, which a cascade adds to). The graph steps themselves grow with the shared keys they read
  again: at batch 64 from 8.7 ms (1,024 shared) to 21.6 ms (8,192), about 4 GB of naive key reads
  (``(B - 1) * shared * bytes per token``) per millisecond at every batch measured.

- the same steps replayed in the graphs' cascade shape (``graphs.py``: both passes and the merge
  inside the captured step) ran at 1.01-1.06x the plain graph step over 1,024 shared tokens (batches
  8, 32, 64) and at 1.15x, 1.77x and 2.35x over 8,192 (``benchmarks/results/engine_h200/round4``):
  never slower in what was measured, and the faster the more keys a step would read again.

So a decode step that replays a graph cascades inside it where the bytes a cascade saves reach
``graph_min_saved_bytes`` (4 GiB: about a millisecond of the re-reads above, against the second
pass and merge), and an eager step (and a verification step, which never replays) only where they
reach ``eager_min_saved_bytes``, by default never. :class:`CascadeRule` takes a step whose sequences
all bring at most ``max_q_len`` new tokens (decodes, speculative verifications), at least
``min_batch`` of them, sharing at least ``min_shared_tokens`` keys (whole pages before every
sequence's new tokens), where the shared keys are most of what the batch reads. The engine has the
rule unless ``enable_cascade_attn=False``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from ..backends.base import AttentionBackend, AttentionSpec
from ..backends.cascade import cascades
from ..runtime.kv_cache import KVPool
from .sequence import Sequence


def shared_prefix_pages(scheduled: list[tuple[Sequence, int]], page_size: int, at_least: int = 1) -> int:
    """The number of leading KV-cache pages that every scheduled sequence holds and that lie wholly
    before each one's new tokens (``num_computed // page_size`` at most); 0 when that is below
    ``at_least``. Compares page ids, which prefix caching makes equal for equal prefixes."""
    limit = min(seq.num_computed for seq, _ in scheduled) // page_size
    if limit < at_least:
        return 0
    first = scheduled[0][0].pages
    head = first[0]
    if any(seq.pages[0] != head for seq, _ in scheduled):  # the common case of unrelated prompts
        return 0
    shared = first[:limit]
    for seq, _ in scheduled[1:]:
        pages = seq.pages[:limit]
        if pages != shared:
            limit = next(i for i, (a, b) in enumerate(zip(shared, pages)) if a != b)
            if limit < at_least:
                return 0
            shared = shared[:limit]
    return limit


@dataclass(frozen=True)
class CascadeRule:
    """Which steps attend through a cascade (see the module docstring). ``bytes_per_token``: the
    K/V bytes of one token over the layers a cascade serves (those without a window, chunk or ALiBi)."""

    bytes_per_token: int
    max_q_len: int = 1
    min_batch: int = 8
    min_shared_tokens: int = 1024
    min_shared_fraction: float = 0.5  # of the batch's keys, counted once per sequence
    graph_min_saved_bytes: int | None = 4 << 30  # None: a step that replays a graph never cascades
    eager_min_saved_bytes: int | None = None  # None: an eager step never cascades

    def shared_tokens(self, scheduled: list[tuple[Sequence, int]], page_size: int, *, replays: bool) -> int:
        """The shared prefix a step of ``scheduled`` attends through a cascade (a multiple of
        ``page_size``), or 0 for plain paged attention. ``replays``: the step replays a captured graph
        (it cascades in the graph's cascade shape if the bytes saved reach ``graph_min_saved_bytes``;
        an eager step if they reach ``eager_min_saved_bytes``)."""
        batch = len(scheduled)
        if batch < self.min_batch or any(n > self.max_q_len for _, n in scheduled):
            return 0
        min_pages = -(-self.min_shared_tokens // page_size)
        shared = shared_prefix_pages(scheduled, page_size, at_least=max(1, min_pages)) * page_size
        if shared == 0:
            return 0
        keys = sum(seq.num_computed + n for seq, n in scheduled)
        saved = (batch - 1) * shared  # key rows the cascade does not read again
        if batch * shared < self.min_shared_fraction * keys:
            return 0
        bound = self.graph_min_saved_bytes if replays else self.eager_min_saved_bytes
        if bound is None or saved * self.bytes_per_token < bound:
            return 0
        return shared


def cascade_rule(
    layers: Seq[AttentionSpec], kv_pool: KVPool, backend: AttentionBackend, max_q_len: int
) -> CascadeRule | None:
    """The rule of a model whose ``layers`` attend over ``kv_pool`` with ``backend``; ``None`` where no
    step can cascade: a cache kind whose layers do not attend through paged attention (MLA's latent
    rows: ``KVPool.cascades``), no layer a cascade computes exactly (every one windowed, chunked or
    with ALiBi), or a backend without non-causal paged attention with the LSE and the merge."""
    caps = backend.capabilities_on(kv_pool.device)
    served = [spec for spec in layers if cascades(spec.params)]
    if (
        not kv_pool.cascades
        or not served
        or "merge_attention_states" not in caps.ops
        or not {"non_causal", "lse"} <= caps.features
    ):
        return None
    itemsize = kv_pool.dtype.itemsize
    per_token = sum(spec.num_kv_heads * (spec.head_dim + spec.v_head_dim) * itemsize for spec in served)
    return CascadeRule(bytes_per_token=per_token, max_q_len=max_q_len)
