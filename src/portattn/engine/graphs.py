"""Captured decode: steps whose sequences each bring one new token replay a graph per batch-size bucket.

A decode step of ``n`` sequences runs as the captured step of the smallest bucket ``B >= n``
(:func:`batch_size_buckets`: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond). Everything the
step reads lives in static buffers at fixed addresses:

* ``inputs [4, B_max]`` int64 on the device: token ids, positions, ``req_to_token`` rows and key
  counts, filled from one pinned host buffer by one copy per step;
* the backend's :class:`~portattn.backends.base.GraphBuffers` (page table at full width, key
  lengths, new-token slots, and what else its op methods read), written by ``backend.plan_into``;
* for an ``"mla"`` cache, the latent-attention plan over the same buffers and a split-KV workspace
  sized for the largest bucket.

The plan of each bucket (``backend.graph_metadata``) is made once, before capture: its Python values
(batch size, split counts, tiles) are fixed per bucket, and everything that changes between steps is
read from device memory. Rows ``n .. B-1`` of a padded step are one-token sequences in the engine's
scratch request row, whose slots all lie in the scratch page: their K/V writes never touch a live page.

Where torch has no graphs for the device (``device.graph_support``), or with ``capture=False``, the
same buffers and plans run eagerly: the CPU tests cover the static path that way.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from .. import device as devices
from ..backends.base import AttentionBackend
from ..mla import plan_mla_decode
from ..models.base import MultimodalModel
from ..models.layers.moe import FusedMoE
from ..runtime.context import ForwardContext
from ..runtime.kv_cache import KVPool
from ..runtime.plan import LatentAttentionPlan
from .req_pool import ReqToTokenPool
from .sequence import Sequence

logger = logging.getLogger("portattn")

# Rows of the static inputs.
IDS, POSITIONS, ROWS, KEY_COUNTS = range(4)


def batch_size_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Captured batch sizes up to ``max_num_seqs``: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond
    (``max_num_seqs`` itself always included)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_num_seqs + 16, 16)]
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


class DecodeGraphs:
    """Static buffers, per-bucket plans and graphs of captured decode steps (one runner's).

    ``capture``: record one graph per bucket (a device with ``graph_support``); ``False`` runs the
    same buffers and plans eagerly. ``scratch_row`` of ``req_pool`` is pointed at ``scratch_page``
    of ``kv_pool`` here; neither may ever be handed to a sequence.
    """

    def __init__(
        self,
        model,
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        *,
        batch_sizes: tuple[int, ...],
        num_heads: int,
        scratch_row: int,
        scratch_page: int,
        capture: bool,
    ):
        if not backend.supports_graphs:
            raise ValueError(f"expected a backend with a graph plan, got {backend.name}")
        if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"expected positive batch sizes, got {batch_sizes!r}")
        self.model, self.backend, self.kv_pool, self.req_pool = model, backend, kv_pool, req_pool
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_batch_size = self.batch_sizes[-1]
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
        self.padding = (0, 0, scratch_row, 1)  # token id, position, row, key count of a padding row

        self.buffers = backend.init_graph_buffers(
            self.max_batch_size, max_pages, page_size, self.device, num_heads=num_heads
        )
        self.inputs = torch.zeros((4, self.max_batch_size), dtype=torch.int64, device=self.device)
        pinned = devices.is_gpu(self.device)
        self.host = torch.zeros((4, self.max_batch_size), dtype=torch.int64, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.copied = torch.Event(device=self.device) if pinned else None
        self.mla_workspace = self._mla_workspace()
        # A decode step of a captured bucket must not sync: the MoE layers take their dense
        # (sync-free) path up to the largest bucket.
        for module in model.modules():
            if isinstance(module, FusedMoE):
                module.dense_max_tokens = max(module.dense_max_tokens, self.max_batch_size)

        self.contexts: dict[int, ForwardContext] = {}
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # decode steps run through the buffers
        self.padded: Counter[int] = Counter()  # sequence count -> steps run padded to a larger bucket
        self.write_step([])  # every row a padding row: valid for the warm-up runs of capture

    # -- setup -----------------------------------------------------------------------------

    def _mla_workspace(self) -> torch.Tensor | None:
        spec = self.kv_pool.spec
        if spec.kind != "mla":
            return None
        from ..mla import mla_workspace_size

        size = max(
            mla_workspace_size(
                self.buffers.max_seqlen_k, b, self.num_heads, self.kv_pool.page_size, kv_lora_rank=spec.kv_lora_rank
            )
            for b in self.batch_sizes
        )
        return torch.empty(size, dtype=torch.uint8, device=self.device) if size else None

    def _latent_plan(self, batch_size: int) -> LatentAttentionPlan | None:
        """The plan a KV cache kind needs beyond the paged metadata, over the static buffers."""
        spec = self.kv_pool.spec
        if spec.kind == "mha":
            return None
        if spec.kind == "mla":
            decode = plan_mla_decode(
                self.buffers.page_table[:batch_size],
                self.buffers.seq_lens_k[:batch_size],
                self.kv_pool.page_size,
                num_heads=self.num_heads,
                kv_lora_rank=spec.kv_lora_rank,
                max_seq_len=self.buffers.max_seqlen_k,
                workspace=self.mla_workspace,
            )
            return LatentAttentionPlan(decode=decode)
        raise ValueError(f"expected a KV cache kind with a graph plan ('mha', 'mla'), got {spec.kind!r}")

    def _context(self, batch_size: int) -> ForwardContext:
        metadata = self.backend.graph_metadata(self.buffers, batch_size, num_heads=self.num_heads)
        return ForwardContext(self.backend, metadata, self.kv_pool, self._latent_plan(batch_size))

    def _forward(self, batch_size: int) -> torch.Tensor:
        ids = self.inputs[IDS, :batch_size]
        positions = self.inputs[POSITIONS, :batch_size]
        return self.model(ids, positions, self.contexts[batch_size])  # [B, H]

    @torch.inference_mode()
    def capture_all(self, progress: Callable[[int], None] | None = None) -> None:
        """Plan every bucket; with ``capture``, run it once (compiling its kernels) and record its graph.

        Largest bucket first, all graphs in one memory pool. ``progress(batch_size)`` is called after each.
        """
        for batch_size in reversed(self.batch_sizes):
            self.contexts[batch_size] = self._context(batch_size)
            if self.capture:
                self._forward(batch_size)  # compiles kernels outside the capture
                devices.synchronize(self.device)
                graph = devices.new_graph(self.device)
                with devices.graph_capture(self.device, graph, self.pool):
                    self.outputs[batch_size] = self._forward(batch_size)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[batch_size] = graph
            if progress is not None:
                progress(batch_size)
        devices.synchronize(self.device)

    # -- steps -----------------------------------------------------------------------------

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds ``num_seqs`` sequences (None: none does)."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def can_run(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """A step of one new token per sequence, no more sequences than the largest bucket, and no
        image placeholder among the new tokens (those need the step's image embeddings)."""
        if not scheduled or len(scheduled) > self.max_batch_size or any(n != 1 for _, n in scheduled):
            return False
        if self.multimodal:
            for seq, _ in scheduled:
                data = seq.multimodal
                if data is not None and data.overlaps_images(seq.num_computed, seq.num_computed + 1):
                    return False
        return True

    def _position(self, seq: Sequence) -> int:
        """The rotary position of the sequence's new token (one number: a token outside every image
        has equal t, h and w positions)."""
        index, data = seq.num_computed, seq.multimodal
        if data is None:
            return index
        if index < data.positions.shape[1]:
            return int(data.positions[0, index])
        return index + data.position_delta

    def write_step(self, scheduled: list[tuple[Sequence, int]]) -> int:
        """Fill the static inputs and the backend's buffers for ``scheduled``; returns the bucket."""
        num_seqs = len(scheduled)
        batch_size = self.bucket(max(num_seqs, 1)) if scheduled else self.max_batch_size
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.host_np
        if scheduled:
            host[IDS, :num_seqs] = [seq.token_ids[seq.num_computed] for seq, _ in scheduled]
            positions = [seq.num_computed for seq, _ in scheduled]
            host[KEY_COUNTS, :num_seqs] = positions
            host[KEY_COUNTS, :num_seqs] += 1
            if self.multimodal:
                positions = [self._position(seq) for seq, _ in scheduled]
            host[POSITIONS, :num_seqs] = positions
            host[ROWS, :num_seqs] = [seq.req_pool_idx for seq, _ in scheduled]
        for row, value in enumerate(self.padding):
            host[row, num_seqs:batch_size] = value
        self.inputs.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.backend.plan_into(
            self.buffers,
            self.req_pool.req_to_token,
            self.inputs[ROWS, :batch_size],
            self.inputs[KEY_COUNTS, :batch_size].int(),
        )
        return batch_size

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Final hidden states ``[n, H]`` of a decode step (:meth:`can_run`), by replay."""
        batch_size = self.write_step(scheduled)
        if batch_size not in self.contexts:
            raise RuntimeError(f"batch size {batch_size} was not captured; call capture_all first")
        self.replays += 1
        if batch_size > len(scheduled):
            self.padded[len(scheduled)] += 1
        if self.capture:
            self.graphs[batch_size].replay()
            hidden = self.outputs[batch_size]
        else:
            hidden = self._forward(batch_size)
        return hidden[: len(scheduled)]


def describe(graphs: DecodeGraphs | None, device: torch.device, reason: str | None = None) -> str:
    """One log line: how decode steps run."""
    if graphs is None:
        return f"decode runs eagerly ({reason})"
    kind = devices.graph_support(device) if graphs.capture else None
    how = f"replays {kind} graphs" if kind else "runs the static-buffer path eagerly (no capture)"
    return f"decode {how} for batch sizes {list(graphs.batch_sizes)}"
