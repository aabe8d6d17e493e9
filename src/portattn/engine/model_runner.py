"""Runs one scheduled step: ForwardBatch -> plan -> model -> logits -> sampled tokens.

The plan step (:meth:`ModelRunner.plan`) makes everything the forward reads before the model runs,
and is the only place a step syncs with the device: the backend's paged metadata, the extra plan the
model's KV cache kind needs beyond it (``kv_pool.plan``), and for multimodal
models the vision encoder's plan and the image embeddings the step needs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from ..backends.base import AttentionBackend
from ..cascade import plan_cascade
from ..device import synchronize, upload
from ..models.base import MultimodalModel
from ..runtime.context import ForwardContext
from ..runtime.kv_cache import KVPool
from .cascade_rule import cascade_rule
from .forward_batch import ForwardBatch, Staging
from .graph_sampling import samples_in_graph
from .graphs import DecodeGraphs, uniform_q_len
from .multimodal import build_multimodal_batch
from .piecewise import TOKEN_BUCKETS, PiecewiseGraphs
from .req_pool import ReqToTokenPool
from .sampler import HostCopy, SamplingBatch, TokenLogprobs, sample, token_logprobs, unpack_logprobs
from .sequence import Sequence


@dataclass(frozen=True)
class LogitRows:
    rows: list[int]  # sampled rows first, then verified rows, then prompt rows
    sampling: list[Sequence]  # the sequences that sample, in the order of their rows
    prompt_rows: list[tuple[Sequence, int, int, int]]  # (sequence, first row, first position, count)
    verifying: list[Sequence] = ()  # sequences with proposed tokens: num_draft_tokens + 1 rows each, in order


# What a step gives each sequence that completed its tokens: the tokens to append (one, or with
# speculative decoding the accepted proposed tokens and one more) and their log-probabilities.
Sampled = dict[Sequence, tuple[list[int], list[TokenLogprobs] | None]]


@dataclass(eq=False)
class Sampling:
    """A step's sampled tokens (and log-probabilities) on their way to the host: ``ModelRunner.sampled``
    reads them. ``tokens``: one token a sequence of ``sampling`` is in the transfer; ``logprobs``: and
    their log-probabilities' rows; ``prompt_parts``: the prompt log-probabilities' sequences and tokens;
    ``ids``: the sampled ids on the device, a row per sequence of ``sampling`` (what a step launched
    before they are read takes as its input, :class:`Feed`)."""

    sampling: list[Sequence]
    tokens: bool
    logprobs: bool
    prompt_parts: list[tuple[Sequence, list[int]]]
    copy: HostCopy
    ids: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Feed:
    """The input ids a step takes on the device from the step before it, launched and not yet read
    (``async_scheduling``): each sequence of ``rows`` has one token in flight, not in its ``token_ids``
    (``num_computed == num_tokens``), which is ``ids[rows[seq]]``; the step decodes it."""

    ids: torch.Tensor  # [N] int64
    rows: dict[Sequence, int]


class ModelRunner:
    """``scratch_row`` / ``scratch_page``: a ``req_to_token`` row and a KV page the engine never hands
    to a sequence, where the padding rows of captured decode steps write (:meth:`enable_graphs`).

    ``uniform_q_lens``: the numbers of new tokens per sequence that make a step a decode: ``(1,)``
    for plain decoding, ``(1, k + 1)`` when speculative decoding verifies ``k`` drafted tokens per
    sequence. A uniform step of one of them replays a captured graph (:meth:`enable_graphs`), and the
    KV cache kind's plan treats sequences of up to the largest as decodes.

    ``verifier``: what turns the logits of sequences with proposed tokens (``num_draft_tokens > 0``)
    into their emitted tokens (speculative decoding installs it; see ``spec_decode``).

    ``cascade`` (the engine's ``enable_cascade_attn``, on by default): steps whose sequences share a long prefix
    attend through a cascade where :class:`~portattn.engine.cascade_rule.CascadeRule` takes them
    (:attr:`cascade_rule`; ``None`` without ``cascade`` or where the model, its cache or the backend
    has no cascade); ``cascade_steps`` counts those steps.
    """

    def __init__(
        self,
        model,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        backend: AttentionBackend,
        eos_token_ids: frozenset[int] = frozenset(),
        *,
        scratch_row: int | None = None,
        scratch_page: int | None = None,
        uniform_q_lens: tuple[int, ...] = (1,),
        cascade: bool = False,
    ):
        if not uniform_q_lens or any(not isinstance(q, int) or isinstance(q, bool) or q < 1 for q in uniform_q_lens):
            raise ValueError(f"expected uniform_q_lens of positive ints, got {uniform_q_lens!r}")
        self.uniform_q_lens = tuple(sorted(set(uniform_q_lens)))
        self.model = model
        self.eos_token_ids = eos_token_ids  # banned while a request is short of min_tokens
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.backend = backend
        self.scratch_row, self.scratch_page = scratch_row, scratch_page
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.verifier: Callable[[torch.Tensor, list[Sequence]], Sampled] | None = None
        self.staging = Staging(kv_pool.device)  # the pinned buffer of every eager step's integers
        layers = model.attention_specs()
        chunks = {layer.attention_chunk_size for layer in layers} - {None}
        if len(chunks) > 1:
            raise ValueError(f"expected one attention_chunk_size across layers, got {sorted(chunks)}")
        self.attention_chunk_size = chunks.pop() if chunks else None
        self.num_heads = max(layer.num_heads for layer in layers)  # sizes split-KV launches
        self.multimodal = isinstance(model, MultimodalModel)
        self.cascade_rule = cascade_rule(layers, kv_pool, backend, self.uniform_q_lens[-1]) if cascade else None
        self.cascade_steps = 0

    def plan(
        self, scheduled: list[tuple[Sequence, int]], shared_prefix_len: int = 0, feed: Feed | None = None
    ) -> tuple[ForwardBatch, ForwardContext]:
        """Everything the forward reads, made before the model runs (every host sync of the step).
        ``shared_prefix_len > 0``: the sequences share their first pages up to it (:meth:`cascade_tokens`),
        and the layers a cascade serves attend through one (the metadata's ``cascade``). ``feed``: the
        input ids of its sequences are copied on the device from the step in flight."""
        fed = () if feed is None else feed.rows
        batch = ForwardBatch.build(
            scheduled, self.req_pool.req_to_token, self.kv_pool.page_size, self.attention_chunk_size, self.staging,
            fed,
        )  # fmt: skip
        if fed:
            if self.multimodal:
                raise ValueError("expected input ids on the host for a multimodal step, got a feed")
            offsets = itertools.accumulate((n for _, n in scheduled), initial=0)
            pairs = [(offset, fed[seq]) for (seq, _), offset in zip(scheduled, offsets) if seq in fed]
            index = upload([i for i, _ in pairs] + [row for _, row in pairs], torch.int64, batch.input_ids.device)
            batch.input_ids.index_copy_(0, index[: len(pairs)], feed.ids.index_select(0, index[len(pairs) :]))
        metadata = self.backend.plan(batch, num_heads=self.num_heads, kv_dtype=self.kv_pool.dtype)
        if shared_prefix_len:
            cascade = plan_cascade(
                self.backend,
                metadata.page_table,
                metadata.cu_seqlens_q,
                metadata.seq_lens_k,
                metadata.page_size,
                shared_prefix_len,
                num_heads=self.num_heads,
                host_lens=(batch.q_lens, batch.k_lens),
                kv_dtype=self.kv_pool.dtype,
            )
            metadata = dataclasses.replace(metadata, cascade=cascade)
            self.cascade_steps += 1
        cache_plan = self.kv_pool.plan(
            self.backend, metadata, num_heads=self.num_heads, decode_q_len=self.uniform_q_lens[-1]
        )
        multimodal = None
        if self.multimodal:
            multimodal = build_multimodal_batch(self.model, scheduled, batch.input_ids.device)  # None: no images
        return batch, ForwardContext(self.backend, metadata, self.kv_pool, cache_plan, multimodal)

    def enable_graphs(
        self, batch_sizes: tuple[int, ...], *, capture: bool, lazy: bool = False, feed: bool = False
    ) -> DecodeGraphs:
        """Run uniform steps of up to ``max(batch_sizes)`` sequences of one of ``uniform_q_lens`` new
        tokens each through static buffers, padded to the next of ``batch_sizes``; ``capture``
        records a graph per (batch size, uniform_q_len) (see ``graphs.py``), at once or with ``lazy``
        when a step first needs it; ``feed``: decode steps may take their input ids from the previous
        step's (``async_scheduling``). Call :meth:`DecodeGraphs.capture_all` on the result before the
        next step."""
        if self.scratch_row is None or self.scratch_page is None:
            raise ValueError("expected a runner built with scratch_row and scratch_page, got None")
        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_pool,
            self.req_pool,
            batch_sizes=batch_sizes,
            uniform_q_lens=self.uniform_q_lens,
            num_heads=self.num_heads,
            scratch_row=self.scratch_row,
            scratch_page=self.scratch_page,
            capture=capture,
            lazy=lazy,
            feed=feed,
        )
        return self.graphs

    def enable_piecewise(self, *, capture: bool, token_buckets: tuple[int, ...] = TOKEN_BUCKETS) -> PiecewiseGraphs:
        """Run eager steps of up to ``max(token_buckets)`` tokens in pieces (``piecewise.py``): captured
        graphs of everything but attention with ``capture``, else the same static inputs eagerly. Call
        :meth:`PiecewiseGraphs.capture_all` on the result before the next step."""
        if self.scratch_row is None or self.scratch_page is None:
            raise ValueError("expected a runner built with scratch_row and scratch_page, got None")
        scratch_slot = self.scratch_page * self.kv_pool.page_size
        self.piecewise = PiecewiseGraphs(
            self.model, self.backend, self.kv_pool, token_buckets=token_buckets, scratch_slot=scratch_slot,
            capture=capture,
        )  # fmt: skip
        return self.piecewise

    def logit_rows(self, scheduled: list[tuple[Sequence, int]], fed: Collection[Sequence] = ()) -> LogitRows:
        """Rows of the step's hidden states that need logits: the last token of each sequence whose
        tokens are then all computed (it samples; with ``d`` proposed tokens, its last ``d + 1`` rows
        are verified), and the prompt positions of sequences that asked for prompt logits or
        log-probabilities. ``fed``: sequences that decode a token in flight (:class:`Feed`): they sample."""
        sample_rows, sampling, prompt_rows, verify_rows, verifying = [], [], [], [], []
        start = 0
        for seq, n in scheduled:
            if seq.params.needs_prompt_logits:
                first = max(seq.num_computed, seq.num_prompt_scored)
                last = min(seq.num_computed + n, seq.num_prompt_tokens)
                if first < last:
                    prompt_rows.append((seq, start + first - seq.num_computed, first, last - first))
            if seq.num_computed + n == seq.num_tokens or seq in fed:
                if seq.num_draft_tokens:
                    verify_rows += range(start + n - 1 - seq.num_draft_tokens, start + n)
                    verifying.append(seq)
                else:
                    sample_rows.append(start + n - 1)
                    sampling.append(seq)
            start += n
        rows = sample_rows + verify_rows + [r for _, row, _, count in prompt_rows for r in range(row, row + count)]
        return LogitRows(rows, sampling, prompt_rows, verifying)

    def cascade_tokens(self, scheduled: list[tuple[Sequence, int]]) -> int:
        """The shared prefix through which the step attends as a cascade (0: plain paged attention):
        :attr:`cascade_rule` for this step. A step that replays a graph cascades in its graph's cascade
        shape (decodes only: a verification step that replays never cascades)."""
        if self.cascade_rule is None:
            return 0
        replays = self.replays(scheduled)
        if replays and uniform_q_len(scheduled) != 1:
            return 0
        return self.cascade_rule.shared_tokens(scheduled, self.kv_pool.page_size, replays=replays)

    def replays(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether the step replays a captured graph: a shape :meth:`DecodeGraphs.can_run` takes (with a
        cascade, the cascade shape of its batch size)."""
        return self.graphs is not None and self.graphs.can_run(scheduled)

    @torch.inference_mode()
    def forward(
        self,
        scheduled: list[tuple[Sequence, int]],
        rows: list[int],
        cascade: int | None = None,
        feed: Feed | None = None,
    ) -> torch.Tensor | None:
        """The logits ``[len(rows), V]`` float32 of the step's hidden-state ``rows`` (``None`` when no row
        needs them): a captured decode step's come from its graph (a view valid until the next step),
        others' from :meth:`logits` of the model's final hidden states ``[T, H]``, one row per new token
        in batch order (replayed when the step is uniform and of a captured shape, else planned and run
        eagerly). ``cascade``: the step's :meth:`cascade_tokens`, when the caller has it (the other
        ranks under tensor parallelism take rank 0's, which every rank runs this step with).
        ``feed``: input ids from the step in flight (:meth:`plan`); such a step runs eagerly (a decode
        step fed from a launched graph's ids is ``DecodeGraphs.launch``'s)."""
        cascade = self.cascade_tokens(scheduled) if cascade is None else cascade
        if feed is None and self.replays(scheduled):
            self.cascade_steps += bool(cascade)
            hidden, logits = self.graphs.run(scheduled, cascade)  # [n * q, H], [n, V] or None
            if logits is None:
                return self.logits(hidden, rows)
            if not rows:
                return None
            if rows == list(range(len(rows))):
                return logits[: len(rows)]
            return logits[torch.tensor(rows, device=logits.device)]
        batch, ctx = self.plan(scheduled, cascade, feed)
        if self.piecewise is not None and self.piecewise.can_run(batch, ctx):
            return self.logits(self.piecewise.run(batch, ctx), rows)
        return self.logits(self.model(batch.input_ids, batch.positions, ctx), rows)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Logits ``[len(rows), V]`` float32 of ``hidden``'s ``rows`` (``None`` for no rows). Every row
        in order (a decode samples each sequence's row; a verification step scores each new token)
        is taken as it is, without a gather."""
        if not rows:
            return None
        if len(rows) != hidden.shape[0] or rows != list(range(len(rows))):
            hidden = hidden[upload(rows, torch.int64, hidden.device)]
        return self.model.compute_logits(hidden).float()  # [N, V]

    @torch.inference_mode()
    def warm_logits(self, max_rows: int) -> None:
        """The LM head (:meth:`logits`) and the greedy draw once at each count of rows from 1 to
        ``max_rows``, over hidden states of zeros.

        An eager step samples one row per sequence, any count up to ``max_num_seqs``, and the matrix
        library chooses the LM head's kernel by that count. A CUDA device loads a kernel the first
        time it runs (lazy module loading, CUDA's default since 12.2), and the load waits for the
        work already queued: a step launched ahead of the previous one's tokens (``run_ahead.py``)
        then waits for that step before the previous one's tokens are read, and every stream stops
        for one step. Run here, at start-up, the loads leave the requests' steps."""
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
            raise ValueError(f"expected max_rows to be a positive int, got {max_rows!r}")
        weight = self.model.lm_head.weight  # [V (this rank's share), H]
        hidden = torch.zeros((max_rows, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        for n in range(1, max_rows + 1):
            torch.argmax(self.logits(hidden[:n], list(range(n))), dim=-1)
        synchronize(weight.device)

    def samples_in_graph(self, scheduled: list[tuple[Sequence, int]], want: LogitRows) -> bool:
        """Whether the step samples inside its captured graph (``graph_sampling.py``): a decode step that
        :meth:`replays` in which every sequence samples, each by the draw alone."""
        return (
            self.graphs is not None
            and len(want.sampling) == len(scheduled)
            and not want.prompt_rows
            and not want.verifying
            and uniform_q_len(scheduled) == 1
            and all(map(samples_in_graph, want.sampling))
            and self.replays(scheduled)
        )

    @torch.inference_mode()
    def step(
        self,
        scheduled: list[tuple[Sequence, int]],
        want: LogitRows | None = None,
        while_running: Callable[[], None] | None = None,
        cascade: int | None = None,
    ) -> Sampled:
        """Run the forward; returns ``(tokens, their log-probabilities or None)`` for each sequence whose
        tokens are now all computed (:data:`Sampled`). Sampled ids and log-probabilities reach the host
        in one transfer (verified sequences in one more). ``want``: :meth:`logit_rows` of
        ``scheduled``, when the caller has it already. ``while_running()``: host work that does not
        need the sampled tokens, called once: while the device runs a step that samples in its graph,
        else after the tokens are on the host. ``cascade``: as :meth:`forward` takes it."""
        want = want if want is not None else self.logit_rows(scheduled)
        cascade = self.cascade_tokens(scheduled) if cascade is None else cascade
        if self.samples_in_graph(scheduled, want):
            self.cascade_steps += bool(cascade)
            tokens = self.graphs.sample(want.sampling, while_running, cascade)
            return {seq: ([token], None) for seq, token in zip(want.sampling, tokens)}
        sampled = self.sample_from(want, self.forward(scheduled, want.rows, cascade))
        if while_running is not None:
            while_running()
        return sampled

    def sample_from(self, want: LogitRows, logits: torch.Tensor | None) -> Sampled:
        """Prompt logits / log-probabilities kept, one token sampled per sequence of ``want.sampling``,
        and the proposed tokens of ``want.verifying`` verified (:attr:`verifier`)."""
        if logits is None:
            return {}
        sampled = self.sampled(self.start_sampling(want, logits))
        if want.verifying:
            if self.verifier is None:
                raise RuntimeError("expected a verifier for sequences with proposed tokens, got none")
            start, num_verified = len(want.sampling), sum(seq.num_draft_tokens + 1 for seq in want.verifying)
            sampled.update(self.verifier(logits[start : start + num_verified], list(want.verifying)))
        return sampled

    def start_sampling(self, want: LogitRows, logits: torch.Tensor, fed: Collection[Sequence] = ()) -> Sampling:
        """The device's part of :meth:`sample_from` (prompt rows and sampled rows; the proposed tokens are
        verified apart): the tokens drawn and their transfer to the host started. ``fed``: sequences
        whose previous token is in flight (it counts among their output tokens)."""
        sampling, prompt_rows = want.sampling, want.prompt_rows
        parts, prompt_parts = [], []
        offset = len(sampling) + sum(seq.num_draft_tokens + 1 for seq in want.verifying)
        for seq, _, first, count in prompt_rows:
            seq_logits = logits[offset : offset + count]  # positions first .. first + count - 1
            offset += count
            seq.num_prompt_scored = first + count
            if seq.params.return_prompt_logits:
                seq.prompt_logits.append(seq_logits.to("cpu", copy=True))
            scored = min(count, seq.num_prompt_tokens - 1 - first)  # position p scores prompt token p + 1
            if seq.params.prompt_logprobs is not None and scored > 0:
                nexts = seq.prompt_token_ids[first + 1 : first + 1 + scored]
                target = upload(nexts, torch.int64, logits.device)
                parts += token_logprobs(seq_logits[:scored], target, seq.params.prompt_logprobs)
                prompt_parts.append((seq, nexts))
        out = None
        if sampling:
            sample_logits = logits[: len(sampling)]
            for i, seq in enumerate(sampling):
                if seq.params.return_logits:
                    seq.logits.append(sample_logits[i].to("cpu", copy=True))  # a graph's logits are reused
            sbatch = SamplingBatch.build(sampling, self.eos_token_ids, sample_logits.shape[-1], logits.device, fed)
            out = sample(sample_logits, sbatch)
            parts = [out.tokens, *parts]
            if out.rows is not None:
                parts += [out.rows, out.logprob, out.rank, out.top_ids, out.top_logprobs]
        logprobs = out is not None and out.rows is not None
        ids = None if out is None else out.tokens
        return Sampling(sampling, out is not None, logprobs, prompt_parts, HostCopy(parts), ids)

    def sampled(self, started: Sampling) -> Sampled:
        """The host's part of :meth:`sample_from`: waits for :meth:`start_sampling`'s transfer."""
        sampling, sampled = started.sampling, {}
        host = started.copy.wait()
        if started.tokens:
            tokens, host = host[0].tolist(), host[1:]
            row_logprobs = {}
            if started.logprobs:
                rows_, *lp = host[-5:]
                host = host[:-5]
                rows_ = rows_.tolist()
                ks = [sampling[r].params.sample_logprobs for r in rows_]
                row_logprobs = dict(zip(rows_, unpack_logprobs([tokens[r] for r in rows_], *lp, ks)))
            for i, seq in enumerate(sampling):
                lp = row_logprobs.get(i)
                sampled[seq] = ([tokens[i]], None if lp is None else [lp])
        for j, (seq, nexts) in enumerate(started.prompt_parts):
            lp = host[4 * j : 4 * j + 4]
            seq.prompt_logprobs += unpack_logprobs(nexts, *lp, [seq.params.prompt_logprobs] * len(nexts))
        return sampled

    def defers(self, want: LogitRows) -> bool:
        """Whether a step's tokens may be read after the call that launched it (:meth:`launch`): it
        scores no prompt, verifies no proposed tokens and keeps no logits (each of those reads the
        device as the step runs)."""
        return not want.prompt_rows and not want.verifying and not any(s.params.return_logits for s in want.sampling)

    @torch.inference_mode()
    def launch(
        self,
        scheduled: list[tuple[Sequence, int]],
        want: LogitRows,
        cascade: int | None = None,
        feed: Feed | None = None,
    ) -> Sampling:
        """A step that :meth:`defers` launched: its forward and sampling queued on the device and the
        tokens on their way to the host; :meth:`sampled` reads them. ``feed``: its fed sequences' input
        ids from the step in flight (``want``: :meth:`logit_rows` with them fed)."""
        logits = self.forward(scheduled, want.rows, cascade, feed)
        if logits is None:
            return Sampling([], False, False, [], HostCopy([]))
        return self.start_sampling(want, logits, () if feed is None else feed.rows)
