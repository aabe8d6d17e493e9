"""Captured uniform steps: decodes (one new token per sequence) and the verification steps of
speculative decoding (``k + 1`` each) replay a graph per (batch-size bucket, ``uniform_q_len``).

A step of ``n`` sequences that each bring ``q`` new tokens (``q`` one of the runner's
``uniform_q_lens``) runs as the captured step of shape ``(B, q)``, ``B`` the smallest bucket
``>= n`` (:func:`batch_size_buckets`: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond). Its
tokens are sequence-major (token ``i`` of sequence ``b`` is row ``b * q + i``). Everything the step
reads lives in static buffers at fixed addresses:

* ``inputs [4, B_max * q_max]`` int64 on the device: token ids and positions (one per token),
  ``req_to_token`` rows and key counts (one per sequence), filled from one pinned host buffer by one
  copy per step;
* the backend's :class:`~portattn.backends.base.GraphBuffers` (page table at full width, key
  lengths, new-token slots, and what else its op methods read), written by ``backend.plan_into``;
* what the KV cache kind plans beyond the backend (``kv_pool.graph_plan``: for a latent cache,
  one absorbed row per new token and a split-KV workspace sized for the largest shape), over the
  same buffers.

The plan of each shape (``backend.graph_metadata``) is made once, before capture: its Python values
(batch size, query length, split counts, tiles) are fixed per shape, and everything that changes
between steps is read from device memory. Rows ``n .. B-1`` of a padded step are sequences of ``q``
tokens in the engine's scratch request row, whose slots all lie in the scratch page: their K/V
writes never touch a live page.

Where torch has no graphs for the device (``device.graph_support``), or with ``capture=False``, the
same buffers and plans run eagerly: the CPU tests cover the static path that way.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from .. import device as devices
from ..backends.base import AttentionBackend
from ..models.base import MultimodalModel
from ..runtime.context import ForwardContext
from ..runtime.kv_cache import KVPool
from .req_pool import ReqToTokenPool
from .sequence import Sequence

logger = logging.getLogger("portattn")

# Rows of the static inputs: per token (IDS, POSITIONS), per sequence (ROWS, KEY_COUNTS).
IDS, POSITIONS, ROWS, KEY_COUNTS = range(4)


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
    eagerly. ``scratch_row`` of ``req_pool`` is pointed at ``scratch_page`` of ``kv_pool`` here;
    neither may ever be handed to a sequence.
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
        self.max_batch_size = self.batch_sizes[-1]
        max_tokens = self.max_batch_size * self.uniform_q_lens[-1]
        self.num_heads = num_heads
        self.device = kv_pool.device
        self.capture = capture
        self.multimodal = isinstance(model, MultimodalModel)
        page_size = kv_pool.page_size
        req_to_token = req_pool.req_to_token
        max_pages = req_to_token.shape[1] // page_size

        # The scratch row: every column a slot of the scratch page.
        columns = torch.arange(req_to_token.shape[1], dtype=torch.int32, device=self.device)
        req_to_token[scratch_row] = scratch_page * page_size + columns % page_size
        self.scratch_row = scratch_row

        self.buffers = backend.init_graph_buffers(
            self.max_batch_size,
            max_pages,
            page_size,
            self.device,
            num_heads=num_heads,
            max_uniform_q_len=self.uniform_q_lens[-1],
        )
        self.inputs = torch.zeros((4, max_tokens), dtype=torch.int64, device=self.device)
        pinned = devices.is_gpu(self.device)
        self.host = torch.zeros((4, max_tokens), dtype=torch.int64, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.copied = torch.Event(device=self.device) if pinned else None
        self.cache_plan = kv_pool.graph_plan(self.buffers, self.shapes, num_heads=num_heads)
        model.prepare_static(max_tokens)  # what a captured step records must not sync

        self.contexts: dict[tuple[int, int], ForwardContext] = {}
        self.graphs: dict[tuple[int, int], object] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # steps run through the buffers
        self.padded: Counter[int] = Counter()  # sequence count -> steps run padded to a larger bucket

    # -- setup -----------------------------------------------------------------------------

    def _context(self, shape: tuple[int, int]) -> ForwardContext:
        batch_size, q = shape
        metadata = self.backend.graph_metadata(self.buffers, batch_size, num_heads=self.num_heads, uniform_q_len=q)
        cache_plan = None if self.cache_plan is None else self.cache_plan.plan(batch_size, q)
        return ForwardContext(self.backend, metadata, self.kv_pool, cache_plan)

    def _forward(self, shape: tuple[int, int]) -> torch.Tensor:
        tokens = shape[0] * shape[1]
        ids = self.inputs[IDS, :tokens]
        positions = self.inputs[POSITIONS, :tokens]
        return self.model(ids, positions, self.contexts[shape])  # [B * q, H]

    @torch.inference_mode()
    def capture_all(self, progress: Callable[[tuple[int, int]], None] | None = None) -> None:
        """Plan every shape; with ``capture``, run it once (compiling its kernels) and record its graph.

        Largest first, all graphs in one memory pool; each shape is planned with every row a padding
        row (valid for the warm-up run). ``progress((batch_size, uniform_q_len))`` is called after each.
        """
        for shape in sorted(self.shapes, key=lambda s: (-s[0] * s[1], -s[1])):
            self.contexts[shape] = self._context(shape)
            self._write([], *shape)
            if self.capture:
                self._forward(shape)  # compiles kernels outside the capture
                devices.synchronize(self.device)
                graph = devices.new_graph(self.device)
                with devices.graph_capture(self.device, graph, self.pool):
                    self.outputs[shape] = self._forward(shape)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[shape] = graph
            if progress is not None:
                progress(shape)
        devices.synchronize(self.device)

    # -- steps -----------------------------------------------------------------------------

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

    def write_step(self, scheduled: list[tuple[Sequence, int]]) -> tuple[int, int]:
        """Fill the static inputs and the plans' buffers for ``scheduled`` (:meth:`can_run`); returns
        the shape ``(batch_size, uniform_q_len)`` it runs as."""
        q = uniform_q_len(scheduled)
        batch_size = self.bucket(len(scheduled))
        self._write(scheduled, batch_size, q)
        return batch_size, q

    def _write(self, scheduled: list[tuple[Sequence, int]], batch_size: int, q: int) -> None:
        num_seqs = len(scheduled)
        tokens, padded_tokens = num_seqs * q, batch_size * q
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.host_np
        if scheduled:
            starts = np.fromiter((seq.num_computed for seq, _ in scheduled), np.int64, num_seqs)  # [n]
            if q == 1:
                host[IDS, :tokens] = [seq.token_ids[seq.num_computed] for seq, _ in scheduled]
            else:
                host[IDS, :tokens] = [
                    t for seq, n in scheduled for t in seq.token_ids[seq.num_computed : seq.num_computed + n]
                ]
            if self.multimodal:
                host[POSITIONS, :tokens] = [p for seq, _ in scheduled for p in self._positions(seq, q)]
            else:
                host[POSITIONS, :tokens] = (starts[:, None] + np.arange(q)).ravel()  # [n * q]
            host[ROWS, :num_seqs] = [seq.req_pool_idx for seq, _ in scheduled]
            host[KEY_COUNTS, :num_seqs] = starts + q
        # Padding rows: q tokens (id 0, positions 0 .. q-1) of the scratch row.
        host[IDS, tokens:padded_tokens] = 0
        host[POSITIONS, tokens:padded_tokens] = np.tile(np.arange(q), batch_size - num_seqs)
        host[ROWS, num_seqs:batch_size] = self.scratch_row
        host[KEY_COUNTS, num_seqs:batch_size] = q
        self.inputs.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.backend.plan_into(
            self.buffers,
            self.req_pool.req_to_token,
            self.inputs[ROWS, :batch_size],
            self.inputs[KEY_COUNTS, :batch_size].int(),
            uniform_q_len=q,
        )
        if self.cache_plan is not None:
            self.cache_plan.plan_into(batch_size, q)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Final hidden states ``[n * q, H]`` of a uniform step (:meth:`can_run`), by replay: every new
        token's row, sequence-major."""
        shape = self.write_step(scheduled)
        if shape not in self.contexts:
            raise RuntimeError(f"shape {shape} was not captured; call capture_all first")
        self.replays += 1
        if shape[0] > len(scheduled):
            self.padded[len(scheduled)] += 1
        if self.capture:
            self.graphs[shape].replay()
            hidden = self.outputs[shape]
        else:
            hidden = self._forward(shape)
        return hidden[: len(scheduled) * shape[1]]


def describe(graphs: DecodeGraphs | None, device: torch.device, reason: str | None = None) -> str:
    """One log line: how decode steps run."""
    if graphs is None:
        return f"decode runs eagerly ({reason})"
    kind = devices.graph_support(device) if graphs.capture else None
    how = f"replays {kind} graphs" if kind else "runs the static-buffer path eagerly (no capture)"
    lens = "" if graphs.uniform_q_lens == (1,) else f" and uniform_q_lens {list(graphs.uniform_q_lens)}"
    return f"decode {how} for batch sizes {list(graphs.batch_sizes)}{lens}"
