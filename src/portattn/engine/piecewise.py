"""Eager steps through captured pieces: a step that no decode graph replays (a prompt chunk, a mixed
step of decodes and a chunk, a batch above the largest graph) of at most ``max(token_buckets)`` new
tokens runs its forward as graphs of everything but attention, with the attention launched between
them from the step's own plan (the piecewise graphs of vLLM).

Why: such a step is launched from Python layer by layer, and on a GPU its host time exceeds its
kernels' (on an H200, 32 decodes beside a 256-token prompt: 9.6 ms of kernels, 24-50 ms of wall time,
``benchmarks/results/engine_h200/round23/NOTES.md``). Everything in a layer but attention depends on
the step only through its token count and device tensors (ids, positions, the new tokens' slots); the
attention also depends on the plan (lengths, page table, split counts, tiles), which changes with
every step.

How: per token-count bucket ``T``, the model's forward over static inputs of ``T`` tokens (ids,
positions, slots: one int64 buffer) is captured with the backend's ``attend`` intercepted: each call
ends the current graph, records its arguments (the queries and the output buffer, allocated inside
the graph, so at fixed addresses; the layer's cache and parameters) as a hole, and begins the next
graph. A step of ``n <= T`` tokens writes its inputs (rows ``n .. T-1`` padding: id 0, position 0,
the scratch slot), then replays the graphs in order and between them calls the backend's ``attend``
on the first ``n`` rows of each hole with the step's plan. Every graph of every bucket shares one
memory pool: the pieces of one forward are captured and replayed in the same order.

The captured forward sees a plan that holds the slots alone (:class:`CaptureMetadata`): a model or
backend that reads anything else of the plan outside ``attend`` raises :class:`NotPiecewise`, and
that bucket's steps stay eager (logged). Without ``capture`` (a device without graphs: the CPU
tests) the same static inputs and holes run eagerly, each hole attending as it is reached.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .. import device as devices
from ..runtime.context import ForwardContext

logger = logging.getLogger("portattn")

IDS, POSITIONS, SLOTS = range(3)
# Token counts captured by default: a step of n tokens runs in the smallest bucket >= n (its padding
# rows cost their share of the projections); longer steps run eagerly, their host time a smaller share
# of their kernels' (a larger bucket would hold 0.5 MB a token more on the Llama-3-8B shape).
TOKEN_BUCKETS = (32, 64, 128, 256, 512)


class NotPiecewise(RuntimeError):
    """The captured forward read a per-step value of the plan outside attention."""


class CaptureMetadata:
    """The plan a captured piece sees: the new tokens' slots (a static buffer); reading anything else
    raises :class:`NotPiecewise` (it would be frozen into the graph at its capture value)."""

    def __init__(self, out_cache_loc: torch.Tensor) -> None:
        self.out_cache_loc = out_cache_loc

    def __getattr__(self, name: str):
        raise NotPiecewise(f"the forward reads the plan's {name!r} outside attention")


@dataclass(frozen=True, eq=False)
class Hole:
    """One ``attend`` call of the captured forward: launched between two graphs with the step's plan."""

    q: torch.Tensor  # [T, Hq, D], written by the graph before
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    params: object  # the layer's AttentionParams (with its cache's scales)
    out: torch.Tensor  # [T, Hq, Dv], read by the graph after


def unsupported(model) -> str | None:
    """Why ``model``'s eager steps cannot run in pieces (None: they can). Routed experts choose their
    path by the token count and sync with the device on the grouped one (a capture cannot); images
    come with per-step embeddings."""
    from ..models.base import MultimodalModel

    if isinstance(model, MultimodalModel):
        return "image inputs"
    if any(callable(getattr(m, "prepare_static", None)) for m in model.modules() if m is not model):
        return "routed experts"
    return None


def buckets_for(budget: int, max_tokens: int | None = None) -> tuple[int, ...]:
    """The token buckets of an engine whose steps hold at most ``budget`` tokens and whose pieces take steps
    of up to ``max_tokens`` (``piecewise_max_tokens``; None: the largest of :data:`TOKEN_BUCKETS`): those of
    :data:`TOKEN_BUCKETS`, then powers of two from 1024, below ``min(budget, max_tokens)``, then that bound
    itself, so that every step up to it has a bucket."""
    largest = min(budget, TOKEN_BUCKETS[-1] if max_tokens is None else max_tokens)
    doubling = [TOKEN_BUCKETS[-1] * 2]
    while doubling[-1] * 2 < largest:
        doubling.append(doubling[-1] * 2)
    return (*(t for t in (*TOKEN_BUCKETS, *doubling) if t < largest), largest)


def memory_estimate(model, buckets: tuple[int, ...], itemsize: int, activations: int, budget: int) -> int:
    """Bytes the pieces of ``buckets`` hold: every hole's queries and output (``T`` rows of each layer's
    heads), and the transient activations of the largest bucket (``activations``, measured for a step of
    ``budget`` tokens, scaled to its size); the engine reserves them beside the decode graphs'."""
    per_token = sum(spec.num_heads * (spec.head_dim + spec.v_head_dim) for spec in model.attention_specs())
    return sum(buckets) * per_token * itemsize + int(activations * min(1.0, max(buckets) / budget))


@contextlib.contextmanager
def attending(backend, attend: Callable) -> Iterator[None]:
    """``backend.attend`` is ``attend`` inside the block (an instance attribute: the backend's own
    ``self.attend`` calls reach it too)."""
    backend.attend = attend
    try:
        yield
    finally:
        del backend.attend


class PiecewiseGraphs:
    """The buckets of one model (see the module's docstring). ``scratch_slot``: a KV slot no sequence
    holds, where the padding rows write their keys and values."""

    def __init__(
        self,
        model,
        backend,
        kv_pool,
        *,
        token_buckets: tuple[int, ...] = TOKEN_BUCKETS,
        scratch_slot: int,
        capture: bool,
    ) -> None:
        if not token_buckets or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in token_buckets):
            raise ValueError(f"expected positive token buckets, got {token_buckets!r}")
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"expected a model whose forward captures in pieces, got one with {reason}")
        self.model, self.backend, self.kv_pool = model, backend, kv_pool
        self.device = kv_pool.device
        self.buckets = tuple(sorted(set(token_buckets)))
        self.capture = capture
        max_tokens = self.buckets[-1]
        self.inputs = torch.zeros((3, max_tokens), dtype=torch.int64, device=self.device)
        self.padding = torch.zeros((3, max_tokens), dtype=torch.int64, device=self.device)
        self.padding[SLOTS] = scratch_slot
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # bucket -> (graphs, holes, hidden [T, H]); a bucket whose capture failed -> why
        self.pieces: dict[int, tuple[list, list[Hole], torch.Tensor]] = {}
        self.skipped: dict[int, str] = {}
        self.steps = 0  # steps run through the pieces

    def bucket(self, num_tokens: int) -> int | None:
        return next((t for t in self.buckets if t >= num_tokens), None)

    def can_run(self, batch, ctx: ForwardContext) -> bool:
        """Whether a planned step runs through the pieces: its bucket was captured (or, without
        ``capture``, planned), and it has no images and no cache plan beyond the backend's."""
        bucket = self.bucket(batch.input_ids.shape[0])
        return bucket is not None and bucket in self.pieces and ctx.multimodal is None and ctx.cache_plan is None

    def _write(self, bucket: int, batch=None) -> None:
        """The static inputs of a step of ``batch`` (None: every row padding), padded to ``bucket``."""
        inputs, n = self.inputs[:, :bucket], 0
        if batch is not None:
            n = batch.input_ids.shape[0]
            inputs[IDS, :n].copy_(batch.input_ids)
            inputs[POSITIONS, :n].copy_(batch.positions)
            inputs[SLOTS, :n].copy_(batch.out_cache_loc)
        if n < bucket:
            inputs[:, n:].copy_(self.padding[:, n:bucket])

    def _context(self, bucket: int) -> ForwardContext:
        return ForwardContext(self.backend, CaptureMetadata(self.inputs[SLOTS, :bucket]), self.kv_pool)

    def _forward(self, bucket: int, ctx: ForwardContext) -> torch.Tensor:
        return self.model(self.inputs[IDS, :bucket], self.inputs[POSITIONS, :bucket], ctx)

    @torch.inference_mode()
    def capture_all(self, progress: Callable[[int], None] | None = None) -> None:
        """Capture every bucket, largest first (without ``capture``: check that each runs from the
        slots alone). A bucket whose forward reads more of the plan is skipped, with a log line."""
        for bucket in reversed(self.buckets):
            try:
                if self.capture:
                    self.pieces[bucket] = self._capture(bucket)
                else:
                    self.warm(bucket)
                    self.pieces[bucket] = ([], [], self.inputs)
            except NotPiecewise as exc:
                self.pieces.pop(bucket, None)
                self.skipped[bucket] = str(exc)
                logger.info("engine: steps of up to %d tokens run eagerly: %s", bucket, exc)
            except Exception as exc:  # a device error mid-capture: said with the way around it
                raise RuntimeError(
                    f"capturing the pieces of {bucket}-token steps failed ({type(exc).__name__}: {exc}); "
                    "piecewise_graphs=False (no --piecewise-graphs) runs these steps eagerly"
                ) from exc
            if progress is not None:
                progress(bucket)
        if self.capture:
            devices.synchronize(self.device)

    @torch.inference_mode()
    def warm(self, bucket: int) -> None:
        """One eager forward of ``bucket`` padding tokens over the static inputs, attention's outputs
        zeros: compiles its kernels (under a compile-ahead rehearsal: only that); raises
        :class:`NotPiecewise` where the forward reads more of the plan than the slots."""
        self._write(bucket)
        with attending(self.backend, lambda q, k, v, metadata, params, out: out.zero_()):
            self._forward(bucket, self._context(bucket))

    def _capture(self, bucket: int) -> tuple[list, list[Hole], torch.Tensor]:
        """A warm-up run (:meth:`warm`), then the pieces and holes."""
        self.warm(bucket)
        ctx = self._context(bucket)
        devices.synchronize(self.device)
        graphs, holes = [], []
        current = [devices.new_graph(self.device)]

        def record(q, k_cache, v_cache, metadata, params, out):
            current[0].capture_end()
            graphs.append(current[0])
            holes.append(Hole(q, k_cache, v_cache, params, out))
            current[0] = devices.new_graph(self.device)
            current[0].capture_begin(pool=self.pool)
            return out

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream), attending(self.backend, record):
            current[0].capture_begin(pool=self.pool)
            try:
                hidden = self._forward(bucket, ctx)
            finally:
                current[0].capture_end()
            graphs.append(current[0])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graphs, holes, hidden

    @torch.inference_mode()
    def run(self, batch, ctx: ForwardContext) -> torch.Tensor:
        """The final hidden states ``[n, H]`` of a planned step (:meth:`can_run`): a view of a static
        buffer, valid until the next step."""
        n = batch.input_ids.shape[0]
        bucket = self.bucket(n)
        self._write(bucket, batch)
        self.steps += 1
        metadata, attend = ctx.metadata, self.backend.attend
        if not self.capture:  # each hole attends as the eager forward reaches it

            def live(q, k_cache, v_cache, _, params, out):
                attend(q[:n], k_cache, v_cache, metadata, params, out[:n])
                return out

            with attending(self.backend, live):
                return self._forward(bucket, self._context(bucket))[:n]
        graphs, holes, hidden = self.pieces[bucket]
        for i, graph in enumerate(graphs):
            graph.replay()
            if i < len(holes):
                hole = holes[i]
                attend(hole.q[:n], hole.k_cache, hole.v_cache, metadata, hole.params, hole.out[:n])
        return hidden[:n]


def describe(piecewise: PiecewiseGraphs | None) -> str | None:
    """One log line: which eager steps replay pieces (None: none)."""
    if piecewise is None:
        return None
    how = "replay captured pieces" if piecewise.capture else "run through the static inputs (no capture)"
    return f"eager steps of up to {max(piecewise.pieces, default=0)} tokens {how} (buckets {sorted(piecewise.pieces)})"
