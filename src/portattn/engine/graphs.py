"""Captured uniform steps: decodes (one new token per sequence) and the verification steps of
speculative decoding (``k + 1`` each) replay a graph per (batch-size bucket, ``uniform_q_len``).

A step of ``n`` sequences that each bring ``q`` new tokens (``q`` one of the runner's
``uniform_q_lens``) runs as the captured step of shape ``(B, q)``, ``B`` the smallest bucket
``>= n`` (:func:`batch_size_buckets`: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond). Its
tokens are sequence-major (token ``i`` of sequence ``b`` is row ``b * q + i``). Everything the step
reads lives in static buffers at fixed addresses:

* one int64 buffer of inputs on the device: token ids and positions (one per token), ``req_to_token``
  rows and key counts (one per sequence), and the per-row parameters of an in-graph draw
  (``graph_sampling.DRAW_ROWS``), filled from one pinned host buffer by one copy per step;
* the backend's :class:`~portattn.backends.base.GraphBuffers` (page table at full width, key
  lengths, new-token slots, and what else its op methods read), written by ``backend.plan_into``
  from the inputs as the first part of the captured step (the host launches no plan kernels);
* what the KV cache kind plans beyond the backend (``kv_pool.graph_plan``: for a latent cache,
  one absorbed row per new token and a split-KV workspace sized for the largest shape), over the
  same buffers.

A decode shape (``q`` 1) ends with the LM head: its graph writes the logits of its rows to a static
``[B_max, V]`` float32 buffer and their argmax to static token ids, so that a step whose sequences
only sample replays it and copies ``B`` ids to the host (``graph_sampling.py``: a step with sampled
rows replays a small draw graph in between); every other step of that shape reads its logits there.
Verification shapes (``q > 1``) end at the final hidden states, and their logits are computed eagerly.

The plan of each shape (``backend.graph_metadata``) is made once, before capture: its Python values
(batch size, query length, split counts, tiles) are fixed per shape, and everything that changes
between steps is read from device memory. Rows ``n .. B-1`` of a padded step are sequences of ``q``
tokens in the engine's scratch request row, whose slots all lie in the scratch page: their K/V
writes never touch a live page.

A decode step whose sequences share their first pages may run as a **cascade shape** ``(B, 1,
CASCADE)`` (``engine/cascade_rule.py`` decides): the same step, with each layer that a cascade serves
attending the shared pages once for all ``B`` queries and each sequence's own keys apart
(:mod:`portattn.cascade`). The shared length is one more static input (SHARED); the plan recorded in
the graph derives two more sets of the backend's buffers from it: the own pass's (each row's page
table past the shared pages, its lengths less the shared length; at least one key, so that padding
rows stay in their scratch page) and the shared pass's (one sequence of ``B`` queries over the first
row's shared pages). Cascade shapes are captured the first time a step needs them.

A step whose every sequence holds at most ``SHORT_KEYS`` keys (its new tokens included) runs as the
**short shape** ``(B, q, SHORT)`` where the backend plans such steps differently
(``graph_metadata(max_seqlen_k=SHORT_KEYS)``): the Triton backend cuts a short decode's keys into
ranges of 64 (``launch.short_splits``), where a long plan keeps 512 or more keys a range, so a
sequence of a few hundred keys is read by several programs at once instead of one tile after another.
Short shapes are captured the first time a step needs them.

A shape is captured at start (:meth:`DecodeGraphs.capture_all`), or with ``lazy`` the first time a
step of that shape runs. Where torch has no graphs for the device (``device.graph_support``), or with
``capture=False``, the same buffers and plans run eagerly: the CPU tests cover the static path that way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from .. import device as devices
from ..backends.base import AttentionBackend
from ..backends.cascade import CascadeMetadata
from ..models.base import MultimodalModel
from ..runtime.context import ForwardContext
from ..runtime.kv_cache import KVPool
from .graph_sampling import DRAW_ROWS, Filters, draw_rows, write_draw_rows
from .req_pool import ReqToTokenPool
from .sampler import argmax_into, draw
from .sequence import Sequence

logger = logging.getLogger("portattn")

# Rows of the static inputs: per token (IDS, POSITIONS); per sequence (ROWS, KEY_COUNTS, FEED, SHARED,
# then the draw's). FEED: the row of the previous decode step whose sampled id is this sequence's input
# (-1: the host's id), for steps launched before the host read the previous step's ids
# (``async_scheduling``). SHARED: its first column is the shared prefix of a cascade shape (tokens).
IDS, POSITIONS = range(2)
ROWS, KEY_COUNTS, FEED, SHARED, DRAW = 0, 1, 2, 3, 4
CASCADE = "cascade"  # the third element of a cascade shape's key: (batch size, 1, CASCADE)
SHORT = "short"  # the third element of a short shape's key: (batch size, q, SHORT)
# Steps whose sequences hold at most this many keys may run as short shapes (the Triton backend's
# launch.SHORT_DECODE_KEYS: its short decodes split into 64-key ranges).
SHORT_KEYS = 512


def longest_of(scheduled: list[tuple[Sequence, int]], q: int) -> int:
    """The most keys a sequence of a uniform step of ``q`` new tokens holds, the new ones included (the
    key count :meth:`DecodeGraphs._write` gives it), before the step is written."""
    return max((seq.num_computed for seq, _ in scheduled), default=0) + q


def uniform_q_len(scheduled: list[tuple[Sequence, int]]) -> int | None:
    """The number of new tokens every sequence of ``scheduled`` brings, or None (none scheduled, or
    counts that differ)."""
    if not scheduled:
        return None
    q = scheduled[0][1]
    return q if all(n == q for _, n in scheduled) else None


def batch_size_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Captured batch sizes up to ``max_num_seqs``: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond
    (``max_num_seqs`` itself always included)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_num_seqs + 16, 16)]
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


class DecodeGraphs:
    """Static buffers, per-shape plans and graphs of captured uniform steps (one runner's).

    ``batch_sizes`` x ``uniform_q_lens``: the shapes captured (``uniform_q_lens`` (1,) for plain
    decoding; (1, k + 1) when speculative decoding verifies k drafted tokens). ``capture``: record one
    graph per shape (a device with ``graph_support``); ``False`` runs the same buffers and plans
    eagerly. ``lazy``: :meth:`capture_all` plans every shape but records none; a shape is recorded the
    first time a step runs it. ``scratch_row`` of ``req_pool`` is pointed at ``scratch_page`` of
    ``kv_pool`` here; neither may ever be handed to a sequence.
    """

    def __init__(
        self,
        model,
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        *,
        batch_sizes: tuple[int, ...],
        uniform_q_lens: tuple[int, ...] = (1,),
        num_heads: int,
        scratch_row: int,
        scratch_page: int,
        capture: bool,
        lazy: bool = False,
        feed: bool = False,
        short_keys: int | None = None,
    ):
        if not backend.supports_graphs:
            raise ValueError(f"expected a backend with a graph plan, got {backend.name}")
        for name, values in (("batch sizes", batch_sizes), ("uniform_q_lens", uniform_q_lens)):
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"expected positive {name}, got {values!r}")
        self.model, self.backend, self.kv_pool, self.req_pool = model, backend, kv_pool, req_pool
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.uniform_q_lens = tuple(sorted(set(uniform_q_lens)))
        self.shapes = tuple((b, q) for q in self.uniform_q_lens for b in self.batch_sizes)
        self.max_batch_size = max_seqs = self.batch_sizes[-1]
        max_tokens = max_seqs * self.uniform_q_lens[-1]
        self.num_heads = num_heads
        self.device = kv_pool.device
        self.capture, self.lazy = capture, lazy
        # Set by the engine while a compile-ahead rehearsal runs (no Triton kernel launches then): steps
        # run their forward eagerly and no graph is recorded, since one would hold none of those kernels.
        self.rehearsing = False
        self.feed = feed  # decode steps may take their input ids from the previous step's (see FEED)
        self.multimodal = isinstance(model, MultimodalModel)
        page_size = kv_pool.page_size
        req_to_token = req_pool.req_to_token
        max_pages = req_to_token.shape[1] // page_size
        self.max_pages = max_pages

        # The scratch row: every column a slot of the scratch page.
        columns = torch.arange(req_to_token.shape[1], dtype=torch.int32, device=self.device)
        req_to_token[scratch_row] = scratch_page * page_size + columns % page_size
        self.scratch_row = scratch_row

        self.buffers = backend.init_graph_buffers(
            max_seqs,
            max_pages,
            page_size,
            self.device,
            num_heads=num_heads,
            max_uniform_q_len=self.uniform_q_lens[-1],
        )
        # Short shapes for steps of at most this many keys a sequence (SHORT_KEYS unless given; 0: none),
        # and whether the plan of each (batch size, q) differs from the long one's (capture_all asks).
        self.short_keys = min(SHORT_KEYS if short_keys is None else short_keys, self.buffers.max_seqlen_k)
        self.short_plans: dict[tuple[int, int], bool] = {}
        # The static inputs: one buffer, [2, max_tokens] per token then [2 + len(DRAW_ROWS), max_seqs] per sequence.
        size = 2 * max_tokens + (DRAW + len(DRAW_ROWS)) * max_seqs
        pinned = devices.is_gpu(self.device)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.token_inputs = self.inputs[: 2 * max_tokens].view(2, max_tokens)
        self.seq_inputs = self.inputs[2 * max_tokens :].view(-1, max_seqs)
        host = self.host.numpy()
        self.host_tokens, self.host_seqs = (
            host[: 2 * max_tokens].reshape(2, -1),
            host[2 * max_tokens :].reshape(-1, max_seqs),
        )
        self.copied = torch.Event(device=self.device) if pinned else None
        # The LM head's outputs of decode shapes: logits [max_seqs, V] float32 (made at the first decode
        # forward, which tells V) and token ids [max_seqs], and the pinned buffer the ids come back through.
        self.logits: torch.Tensor | None = None
        self.tokens = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)
        # Two of each: a step launched ahead fetches into one while the host has yet to read the other.
        self.host_ids = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.fetched = [torch.Event(device=self.device) for _ in range(2)] if pinned else None
        self.launches = 0  # decode steps launched by launch(); picks the host buffer
        self.cache_plan = kv_pool.graph_plan(self.buffers, self.shapes, num_heads=num_heads)
        model.prepare_static(max_tokens)  # what a captured step records must not sync

        # (own pass, shared pass) GraphBuffers, row ids and token columns: made for the first cascade shape
        self.cascade_buffers = self.row_ids = self.columns = None
        self.contexts: dict[tuple, ForwardContext] = {}
        self.graphs: dict[tuple, object] = {}  # (batch size, uniform_q_len[, CASCADE]) -> graph
        self.draw_graphs: dict[tuple[int, Filters], object] = {}  # (batch size, filters) -> graph
        self.outputs: dict[object, torch.Tensor] = {}  # a graph's key -> its output (a static tensor)
        self.pool = None
        self.replays = 0  # steps run through the buffers
        self.sampled = 0  # of which sampled in the graph (graph_sampling.py)
        self.padded: Counter[int] = Counter()  # sequence count -> steps run padded to a larger bucket

    # -- setup -----------------------------------------------------------------------------

    def _context(self, shape: tuple) -> ForwardContext:
        batch_size, q = shape[:2]
        kv = self.kv_pool.dtype
        longest = self.short_keys if shape[2:] == (SHORT,) else None
        metadata = self.backend.graph_metadata(
            self.buffers, batch_size, num_heads=self.num_heads, uniform_q_len=q, kv_dtype=kv, max_seqlen_k=longest
        )
        if shape[2:] == (CASCADE,):  # the own pass per row, the shared pass as one sequence of B queries
            own, shared = self._cascade_buffers()
            heads = self.num_heads
            cascade = CascadeMetadata(
                shared=self.backend.graph_metadata(shared, 1, num_heads=heads, uniform_q_len=batch_size, kv_dtype=kv),
                own=self.backend.graph_metadata(own, batch_size, num_heads=heads, uniform_q_len=1, kv_dtype=kv),
                shared_prefix_len=0,  # per step, on the device (SHARED)
            )
            metadata = dataclasses.replace(metadata, cascade=cascade)
        cache_plan = None if self.cache_plan is None else self.cache_plan.plan(batch_size, q)
        return ForwardContext(self.backend, metadata, self.kv_pool, cache_plan)

    def _cascade_buffers(self):
        if self.cascade_buffers is None:
            make, p, heads = self.backend.init_graph_buffers, self.kv_pool.page_size, self.num_heads
            max_seqs = self.max_batch_size
            self.cascade_buffers = (
                make(max_seqs, self.max_pages, p, self.device, num_heads=heads, max_uniform_q_len=1),
                make(1, self.max_pages, p, self.device, num_heads=heads, max_uniform_q_len=max_seqs),
            )
            self.row_ids = torch.arange(max_seqs, device=self.device)
            self.columns = torch.arange(self.req_pool.req_to_token.shape[1], device=self.device)
        return self.cascade_buffers

    def _plan(self, shape: tuple) -> None:
        """The step's plan from the static inputs: the backend's buffers (page table, lengths, new-token
        slots) and the cache kind's; for a cascade shape also the own and shared passes' buffers. Device
        work only, recorded at the start of the shape's graph, so a replay plans itself and the host
        launches one graph instead of the plan's dozens of kernels."""
        batch_size, q = shape[:2]
        req_to_token = self.req_pool.req_to_token
        rows, key_counts = self.seq_inputs[ROWS, :batch_size], self.seq_inputs[KEY_COUNTS, :batch_size]
        self.backend.plan_into(self.buffers, req_to_token, rows, key_counts.int(), uniform_q_len=q)
        if shape[2:] == (CASCADE,):
            own, shared = self.cascade_buffers
            shared_len = self.seq_inputs[SHARED, :1]  # [1] tokens, whole pages
            width = req_to_token.shape[1]
            # Each row's token slots from the shared length on (the tail repeats the last column: never read).
            columns = (self.columns + shared_len).clamp(max=width - 1)  # [width]
            own_rows = req_to_token.index_select(0, rows).gather(1, columns.expand(batch_size, width))
            own_lens = (key_counts - shared_len).clamp(min=1).int()  # padding rows: one scratch key
            self.backend.plan_into(own, own_rows, self.row_ids[:batch_size], own_lens, uniform_q_len=1)
            # The shared pass's page table and length: planned as one key run (q 1); its metadata reads B
            # queries, non-causal and without a window, so no query position enters its mask.
            self.backend.plan_into(shared, req_to_token, rows[:1], shared_len.int(), uniform_q_len=1)
        if self.cache_plan is not None:
            self.cache_plan.plan_into(batch_size, q)
        if self.feed and q == 1:  # rows fed from the previous step's sampled ids
            ids, feed = self.token_inputs[IDS, :batch_size], self.seq_inputs[FEED, :batch_size]
            ids.copy_(torch.where(feed >= 0, self.tokens.index_select(0, feed.clamp(min=0)), ids))

    def _forward(self, shape: tuple) -> torch.Tensor:
        """What a shape's graph records: the step's plan (:meth:`_plan`), the model over the static inputs
        ``[B * q, H]``; for a decode shape also the LM head into the static logits and their argmax into
        the static ids."""
        self._plan(shape)
        batch_size, q = shape[:2]
        tokens = batch_size * q
        ids = self.token_inputs[IDS, :tokens]
        positions = self.token_inputs[POSITIONS, :tokens]
        hidden = self.model(ids, positions, self.contexts[shape])  # [B * q, H]
        if q == 1:
            logits = self.model.compute_logits(hidden).float()  # [B, V]
            if self.logits is None:  # a plain tensor, made outside any capture (the first run is eager)
                with torch.inference_mode(False):
                    self.logits = torch.empty((self.max_batch_size, logits.shape[-1]), device=self.device)
            argmax_into(logits, self.tokens[:batch_size], copy_into=self.logits[:batch_size])
        return hidden

    def _draw(self, batch_size: int, filters: Filters) -> torch.Tensor:
        """What a draw graph records: :func:`~portattn.engine.sampler.draw` over the static logits of
        ``batch_size`` rows, into the static ids."""
        rows = draw_rows(self.seq_inputs[DRAW:], batch_size, filters)
        return self.tokens[:batch_size].copy_(draw(self.logits[:batch_size], rows))

    def _record(self, key, graphs: dict, fn: Callable[[], torch.Tensor]) -> None:
        """Run ``fn`` once (compiling its kernels), then record it as the graph of ``key`` in ``graphs``
        (every graph in one memory pool)."""
        fn()
        devices.synchronize(self.device)
        graph = devices.new_graph(self.device)
        with devices.graph_capture(self.device, graph, self.pool):
            self.outputs[key] = fn()
        if self.pool is None:
            self.pool = graph.pool()
        graphs[key] = graph

    def _replay(self, key, graphs: dict, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fn()``'s result: by replay of the graph of ``key`` (recorded now if it is not yet), or
        eagerly without capture (and during a rehearsal: :attr:`rehearsing`)."""
        if not self.capture or self.rehearsing:
            return fn()
        if key not in graphs:
            self._record(key, graphs, fn)
        graphs[key].replay()
        return self.outputs[key]

    @torch.inference_mode()
    def capture_all(self, progress: Callable[[tuple[int, int]], None] | None = None) -> None:
        """Plan every shape; with ``capture`` and not ``lazy``, run it once (compiling its kernels) and
        record its graph.

        Largest first, all graphs in one memory pool; each shape is planned with every row a padding
        row (valid for the warm-up run). ``progress((batch_size, uniform_q_len))`` is called after each.
        """
        for shape in sorted(self.shapes, key=lambda s: (-s[0] * s[1], -s[1])):
            if shape not in self.contexts:  # (one a rehearsal planned is kept)
                self.contexts[shape] = self._context(shape)
            self.short_plans[shape] = self._short_plan_differs(shape)  # its short shape is captured when needed
            if self.capture and not self.lazy:
                self._write([], *shape)
                self._record(shape, self.graphs, lambda shape=shape: self._forward(shape))
            if progress is not None:
                progress(shape)
        devices.synchronize(self.device)

    def start_shapes(self) -> list[tuple]:
        """The shapes a start-up records, largest first (every shape; with ``lazy``, the batch-1
        decode that the warm-up's prompts record), each followed by its short shape where that is
        planned apart (recorded when a step first needs it)."""
        shapes = sorted(self.shapes, key=lambda s: (-s[0] * s[1], -s[1]))
        if self.lazy:
            shapes = [s for s in shapes if s == (1, 1)]
        return [v for s in shapes for v in ((s, (*s, SHORT)) if self._short_plan_differs(s) else (s,))]

    @torch.inference_mode()
    def rehearse(self, shapes: list[tuple]) -> None:
        """The forward of each of ``shapes`` once, eagerly, with every row a padding row, as
        :meth:`capture_all`'s first run of a shape: under ``kernels.triton.compile_ahead`` the kernels
        that recording them launches are compiled (in parallel) and none runs."""
        for shape in shapes:
            if shape not in self.contexts:
                self.contexts[shape] = self._context(shape)
            self._write([], *shape[:2])
            self._forward(shape)
        devices.synchronize(self.device)

    @property
    def num_captured(self) -> int:
        """Graphs recorded so far (decode shapes and draws)."""
        return len(self.graphs) + len(self.draw_graphs)

    # -- steps -----------------------------------------------------------------------------

    def recorded(self, num_seqs: int, q: int = 1, longest: int | None = None) -> bool:
        """Whether a step of ``num_seqs`` sequences of ``q`` tokens (holding at most ``longest`` keys a
        sequence, its new tokens included; None: any number) replays without recording its graph first
        (always without capture). A step fed from the previous step's ids must: recording runs the step
        once, which overwrites those ids before the replay reads them."""
        return not self.capture or self._shape(self.bucket(num_seqs), q, 0, longest) in self.graphs

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds ``num_seqs`` sequences (None: none does)."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def can_run(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """A uniform step (every sequence the same number of new tokens, one of ``uniform_q_lens``), of
        no more sequences than the largest bucket, with no image placeholder among the new tokens
        (those need the step's image embeddings)."""
        q = uniform_q_len(scheduled)
        if q not in self.uniform_q_lens or len(scheduled) > self.max_batch_size:
            return False
        if self.multimodal:
            for seq, _ in scheduled:
                data = seq.multimodal
                if data is not None and data.overlaps_images(seq.num_computed, seq.num_computed + q):
                    return False
        return True

    def _positions(self, seq: Sequence, q: int) -> list[int]:
        """The rotary positions of the sequence's new tokens (one number each: a token outside every
        image has equal t, h and w positions)."""
        start, data = seq.num_computed, seq.multimodal
        if data is None:
            return list(range(start, start + q))
        prompt = data.positions.shape[1]
        return [int(data.positions[0, i]) if i < prompt else i + data.position_delta for i in range(start, start + q)]

    def write_step(self, scheduled: list[tuple[Sequence, int]], cascade: int = 0) -> tuple:
        """Fill the static inputs for ``scheduled`` (:meth:`can_run`); returns the shape ``(batch_size,
        uniform_q_len)`` it runs as, whose replay plans and runs the step; with ``cascade`` (a shared
        prefix of that many tokens, decodes only) the cascade shape ``(batch_size, 1, CASCADE)``."""
        q = uniform_q_len(scheduled)
        batch_size = self.bucket(len(scheduled))
        self._write(scheduled, batch_size, q, cascade=cascade)
        return self._shape(batch_size, q, cascade, self._written_longest(batch_size))

    def _shape(self, batch_size: int, q: int, cascade: int, longest: int | None = None) -> tuple:
        """The key of a step of ``batch_size`` (a bucket) x ``q`` tokens: the cascade shape with a
        shared prefix, the short shape for ``longest`` keys a sequence at most ``short_keys`` where its
        plan differs, else ``(batch_size, q)``."""
        if cascade:
            if q != 1:
                raise ValueError(f"expected a cascade shape of decodes (one new token each), got {q} new tokens")
            return batch_size, 1, CASCADE
        if longest is not None and longest <= self.short_keys and self.short_plans.get((batch_size, q)):
            return batch_size, q, SHORT
        return batch_size, q

    def _short_plan_differs(self, shape: tuple[int, int]) -> bool:
        """Whether the backend plans steps of ``shape`` with at most ``short_keys`` keys a sequence
        otherwise than the long plan (their ``launch_key``: the Triton backend's split count and
        tiles); never for a cache kind with a plan of its own (MLA's latent cache)."""
        batch_size, q = shape
        if self.cache_plan is not None or self.short_keys < q:
            return False
        plan = self.backend.graph_metadata
        args = dict(num_heads=self.num_heads, uniform_q_len=q, kv_dtype=self.kv_pool.dtype)
        long, short = (plan(self.buffers, batch_size, **args, max_seqlen_k=n) for n in (None, self.short_keys))
        return long.launch_key != short.launch_key

    def _write(
        self,
        scheduled: list[tuple[Sequence, int]],
        batch_size: int,
        q: int,
        sampling: bool = False,
        feed: list[int] | None = None,
        cascade: int = 0,
    ) -> Filters | None:
        """The step's inputs (and with ``sampling`` the draw's parameters of its rows: returns their
        filters, None when every row is greedy) into the pinned buffer, and one copy to the device (the
        plan is part of the replay: :meth:`_plan`). ``feed`` (a decode launched ahead): each sequence's
        row in the previous step, whose sampled id is its input; its ``token_ids`` lack that token."""
        num_seqs = len(scheduled)
        tokens, padded_tokens = num_seqs * q, batch_size * q
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        host, seqs = self.host_tokens, self.host_seqs
        if scheduled:
            starts = np.fromiter((seq.num_computed for seq, _ in scheduled), np.int64, num_seqs)  # [n]
            if feed is not None:
                host[IDS, :tokens] = 0  # the device's ids of the previous step replace them
            elif q == 1:
                host[IDS, :tokens] = np.fromiter(
                    (seq.token_ids[seq.num_computed] for seq, _ in scheduled), np.int64, num_seqs
                )
            else:
                host[IDS, :tokens] = [
                    t for seq, n in scheduled for t in seq.token_ids[seq.num_computed : seq.num_computed + n]
                ]
            if self.multimodal:
                host[POSITIONS, :tokens] = [p for seq, _ in scheduled for p in self._positions(seq, q)]
            else:
                host[POSITIONS, :tokens] = (starts[:, None] + np.arange(q)).ravel()  # [n * q]
            seqs[ROWS, :num_seqs] = np.fromiter((seq.req_pool_idx for seq, _ in scheduled), np.int64, num_seqs)
            seqs[KEY_COUNTS, :num_seqs] = starts + q
        # Padding rows: q tokens (id 0, positions 0 .. q-1) of the scratch row.
        host[IDS, tokens:padded_tokens] = 0
        host[POSITIONS, tokens:padded_tokens] = np.tile(np.arange(q), batch_size - num_seqs)
        seqs[ROWS, num_seqs:batch_size] = self.scratch_row
        seqs[KEY_COUNTS, num_seqs:batch_size] = q
        seqs[FEED, :batch_size] = -1
        seqs[SHARED, 0] = cascade
        if feed is not None:
            seqs[FEED, :num_seqs] = feed
        ahead = 0 if feed is None else 1
        seq_list = [seq for seq, _ in scheduled]
        filters = write_draw_rows(seqs[DRAW:], seq_list, batch_size, ahead) if sampling else None
        self.inputs.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return filters

    def _written_longest(self, batch_size: int) -> int:
        """The most keys a row of the step just written holds (its key counts in the pinned inputs)."""
        return int(self.host_seqs[KEY_COUNTS, :batch_size].max())

    def _run_model(self, shape: tuple, num_seqs: int) -> torch.Tensor:
        if shape not in self.contexts:
            if len(shape) == 2:
                raise RuntimeError(f"shape {shape} was not planned; call capture_all first")
            self.contexts[shape] = self._context(shape)  # a cascade or short shape, planned when first needed
        self.replays += 1
        if shape[0] > num_seqs:
            self.padded[num_seqs] += 1
        return self._replay(shape, self.graphs, lambda: self._forward(shape))

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]], cascade: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A uniform step (:meth:`can_run`) by replay: the final hidden states ``[n * q, H]`` of every new
        token, sequence-major, and for a decode shape (``q`` 1) the logits ``[n, V]`` float32 of its
        rows (else None). Both are views of static buffers, valid until the next step. ``cascade``: the
        step's shared prefix (tokens, whole pages before every new token), run as a cascade shape."""
        shape = self.write_step(scheduled, cascade)
        n = len(scheduled)
        hidden = self._run_model(shape, n)
        logits = self.logits[:n] if shape[1] == 1 else None
        return hidden[: n * shape[1]], logits

    @torch.inference_mode()
    def sample(
        self, seqs: list[Sequence], while_running: Callable[[], None] | None = None, cascade: int = 0
    ) -> list[int]:
        """The next token of each of ``seqs`` (a decode step, :meth:`can_run`, in which every sequence
        samples in the graph: ``graph_sampling.samples_in_graph``): the step's graph, then for sampled
        rows the draw's, then one copy of the ids to the host. ``while_running()`` is called once the
        device has the work and before the host waits for the ids. ``cascade``: as :meth:`run`."""
        launched = self.launch(seqs, cascade=cascade)
        if while_running is not None:
            while_running()
        return self.collect(launched)

    @torch.inference_mode()
    def launch(
        self,
        seqs: list[Sequence],
        feed: list[int] | None = None,
        cascade: int = 0,
        feed_ids: torch.Tensor | None = None,
    ) -> tuple[int, int | list[int]]:
        """Start the decode step of :meth:`sample` and the copy of its ids to the host, without waiting:
        a handle for :meth:`collect`. ``feed`` (the graphs made with ``feed``): each sequence's row in the
        previously launched step, whose sampled id is its input (:meth:`_write`); ``feed_ids``: that
        step's sampled ids where it ran eagerly (else this graph's last ids are). Two launched steps may
        be uncollected at a time. ``cascade``: as :meth:`run` (not with ``feed``)."""
        if feed is not None and not self.feed:
            raise RuntimeError("decode graphs made without feed cannot take their ids from the previous step")
        scheduled = [(seq, 1) for seq in seqs]
        n, batch_size = len(seqs), self.bucket(len(seqs))
        if feed is not None and cascade:
            raise ValueError("expected a cascade step to read its input ids from the host, got feed rows")
        if feed is not None and feed_ids is not None:  # the eager step's ids where the graph reads its own
            self.tokens[:n].copy_(feed_ids.index_select(0, devices.upload(feed, torch.int64, self.device)))
            feed = list(range(n))
        filters = self._write(scheduled, batch_size, 1, sampling=True, feed=feed, cascade=cascade)
        self._run_model(self._shape(batch_size, 1, cascade, self._written_longest(batch_size)), n)
        if filters is not None:
            self._replay((batch_size, filters), self.draw_graphs, lambda: self._draw(batch_size, filters))
        self.sampled += 1
        if self.fetched is None:  # no pinned copies here: the ids now (the next step overwrites them)
            return n, self.tokens[:n].tolist()
        slot = self.launches % 2
        self.launches += 1
        self.host_ids[slot][:n].copy_(self.tokens[:n], non_blocking=True)
        self.fetched[slot].record()
        return n, slot

    def collect(self, launched: tuple[int, int | list[int]]) -> list[int]:
        """The sampled ids of a :meth:`launch`ed step (waits for them)."""
        n, where = launched
        if isinstance(where, list):
            return where
        self.fetched[where].synchronize()
        return self.host_ids[where][:n].tolist()


def describe(graphs: DecodeGraphs | None, device: torch.device, reason: str | None = None) -> str:
    """One log line: how decode steps run."""
    if graphs is None:
        return f"decode runs eagerly ({reason})"
    kind = devices.graph_support(device) if graphs.capture else None
    how = f"replays {kind} graphs" if kind else "runs the static-buffer path eagerly (no capture)"
    if kind and graphs.lazy:
        how += " (each captured when first used)"
    lens = "" if graphs.uniform_q_lens == (1,) else f" and uniform_q_lens {list(graphs.uniform_q_lens)}"
    return f"decode {how} for batch sizes {list(graphs.batch_sizes)}{lens}"
