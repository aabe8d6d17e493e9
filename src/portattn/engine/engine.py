"""The engine core: model, KV pool, scheduler and runner, advanced one step at a time."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time

import torch
from tqdm.auto import tqdm

from ..device import graph_support, is_gpu
from ..distributed.group import TPGroup, tp_or_single
from ..errors import all_ints, is_int
from ..models import loader
from ..paging import PageAllocator, num_pages_for
from ..runtime.multimodal import MultimodalData
from . import memory, piecewise
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .generation_config import sampling_defaults
from .graphs import batch_size_buckets, describe
from .model_runner import ModelRunner
from .model_setup import model_kv_pool, select_attention_backend
from .page_manager import PageManager
from .req_pool import ReqToTokenPool
from .run_ahead import RunAhead
from .sampler import bad_word_token_ids, sample_key
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .spec_decode.draft_model import load_draft_model
from .spec_decode.speculator import build_speculator

logger = logging.getLogger("portattn")

# Prompt lengths of the warm-up requests: the query-tile classes of prefill (long and short runs)
# and of decode, compiled before the first request.
WARM_UP_PROMPTS = (256, 16, 1)
# Mixed steps rehearsed at start (compiled, not run): decodes first, then one prompt chunk. A mixed step
# launches its decodes apart from the chunk: the decodes with tiles and a split count chosen by their
# count and context (short key ranges, split, unsplit by programs a multiprocessor), the chunk with the
# tiles of its length (query rows a program) and a split count of its own (a short chunk over a long
# prefix splits). On an H200 a server on an empty Triton cache compiled 18 attention variants after a
# warm-up of whole prompts alone, each holding up its step for 1-3 s
# (benchmarks/results/engine_h200/round22/NOTES.md). The decodes' classes are rehearsed before a chunk
# of MIXED_DECODE_CHUNK new tokens, the chunks' after one decode over MIXED_CONTEXTS[0] keys.
MIXED_DECODES = (1, 3, 16, 48, 128)  # decoding sequences
MIXED_CONTEXTS = (64, 500, 2000)  # their keys
MIXED_DECODE_CHUNK = 16
MIXED_CHUNKS = ((256, 0), (64, 1000), (16, 0), (16, 2000), (8, 0), (8, 1000), (4, 0), (4, 1000))  # (new, cached)


DEFAULT_MAX_MODEL_LEN = 8192  # for a model config without max_position_embeddings


def max_model_len(config: EngineConfig, max_position_embeddings: int | None) -> int:
    """The longest request (prompt and output): ``config.max_model_len`` or the model's limit."""
    if config.max_model_len is None:
        return max_position_embeddings or DEFAULT_MAX_MODEL_LEN
    if max_position_embeddings is not None and config.max_model_len > max_position_embeddings:
        if not config.allow_long_max_model_len:
            raise ValueError(
                f"expected max_model_len <= the model's max_position_embeddings {max_position_embeddings}, "
                f"got {config.max_model_len} (allow_long_max_model_len=True, --allow-long-max-model-len, accepts it)"
            )
        logger.warning(
            "max_model_len %d exceeds max_position_embeddings %d", config.max_model_len, max_position_embeddings
        )
    return config.max_model_len


class Engine:
    """One engine, or one rank's engine under tensor parallelism: ``tp`` (this rank's
    :class:`TPGroup`) builds the rank's shard. Rank 0's engine also gets ``parallel``, its handle
    on the other ranks, and sends them each step through it. Build engines with
    :func:`portattn.engine.build.build_engine`, which starts the ranks when the configuration asks
    for several."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, parallel=None):
        if config.tensor_parallel_size > 1 and tp is None:
            raise ValueError(
                f"expected the TPGroup of this rank for tensor_parallel_size {config.tensor_parallel_size}, got none "
                "(portattn.engine.build.build_engine starts the ranks and builds their engines)"
            )
        self.parallel = None
        # Every rank builds and warms up the same engine on its own (the same steps in the same
        # order, so their collectives meet); rank 0 sends steps from then on.
        req_pool_class = parallel.req_pool_class if parallel is not None else ReqToTokenPool
        self._build(config, tp_or_single(tp), req_pool_class)
        if parallel is not None:
            parallel.attach(self.req_pool)
            self.parallel = parallel

    def _build(self, config: EngineConfig, tp: TPGroup, req_pool_class: type[ReqToTokenPool]) -> None:
        from ..kernels.triton import compile_ahead

        # Worker processes for the compiles of the memory profile's step and of the warm-up (a CUDA GPU with
        # Triton): spawned now on a fresh Triton cache, else at the first compile that the cache does not hold;
        # ended after the warm-up.
        cores = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
        started = compile_ahead.start_workers(config.device, min(compile_ahead.MAX_WORKERS, cores))
        try:
            self._build_and_warm_up(config, tp, req_pool_class)
        finally:
            if started:
                compile_ahead.stop_workers()

    def _build_and_warm_up(self, config: EngineConfig, tp: TPGroup, req_pool_class: type[ReqToTokenPool]) -> None:
        self.config = config
        self.tp = tp
        self.hf_config = loader.load_config(config.model)
        text_config = getattr(self.hf_config, "text_config", None) or self.hf_config
        self.max_model_len = max_model_len(config, getattr(text_config, "max_position_embeddings", None))
        # What requests that leave them unset sample with; rank 0 alone adds requests.
        self.sampling_defaults = sampling_defaults(config.generation_config, config.model) if tp.rank == 0 else {}
        if config.num_pages is not None:  # refused before the weights load
            memory.pool_pages(config, self.max_model_len, bytes_per_page=None)
        # Without num_pages / kv_cache_memory, an accelerator's KV cache is sized from what is measured
        # from here on (memory.py); None on the CPU.
        sizing = memory.snapshot(config.device) if config.num_pages is None and config.kv_cache_memory is None else None
        model_options = dict(mm_attention_backend=config.mm_attention_backend, tp=tp, quantization=config.quantization)
        self.model = loader.load_model(config.model, config.dtype, config.device, self.hf_config, **model_options)
        self.tokenizer = loader.load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = loader.eos_token_ids(config.model, self.hf_config)
        self.vocab_size = text_config.vocab_size
        # Speculative decoding's draft model lives on rank 0; its weights count in the measured use and
        # its pool (as many pages as the target's) in the bytes of a page.
        speculative = config.speculative_config
        draft = None
        if speculative is not None and speculative.method == "draft_model" and tp.rank == 0:
            draft = load_draft_model(speculative, config, self.vocab_size, self.tokenizer, self.max_model_len)

        self.backend = select_attention_backend(self.model, config)
        page_size, kv_dtype = config.page_size, config.kv_cache_dtype
        spec = self.model.kv_cache_spec()
        use = None
        if sizing is not None:
            graphs = self._eager_reason() is None
            use = memory.measure(
                sizing, self.model, self.backend, spec, kv_dtype, config, self.max_model_len, graphs=graphs
            )
            if config.piecewise_graphs and self._piecewise_reason(self._eager_reason(), kv_pool=False) is None:
                budget = config.max_num_batched_tokens
                itemsize = torch.empty((), dtype=config.dtype).element_size()
                buckets = piecewise.buckets_for(budget, config.piecewise_max_tokens)
                held = piecewise.memory_estimate(self.model, buckets, itemsize, use.activations, budget)
                use = dataclasses.replace(use, graphs=use.graphs + held)
        page_bytes = spec.bytes_per_page(page_size, kv_dtype)
        if draft is not None:
            page_bytes += draft.kv_cache_spec().bytes_per_page(page_size, kv_dtype)
        num_pages = memory.pool_pages(config, self.max_model_len, page_bytes, use)
        num_pages = memory.agree_across_ranks(num_pages, tp) if use is not None else num_pages
        # One page and one request row beyond what sequences get: the scratch that the padding rows
        # of captured decode steps write to (graphs.py). The allocator never hands them out.
        self.kv_pool = model_kv_pool(self.model, config.model, config, num_pages + 1)
        self.allocator = PageAllocator(num_pages)
        self.req_pool = req_pool_class(
            config.max_num_seqs + 1, num_pages_for(self.max_model_len, page_size) * page_size, page_size, config.device
        )
        scratch_row = self.req_pool.alloc()
        self.pages = PageManager(self.allocator, self.req_pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pages,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.long_prefill_token_threshold,
            config.max_num_partial_prefills,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            self.req_pool,
            self.backend,
            frozenset(self.eos_token_ids),
            scratch_row=scratch_row,
            scratch_page=num_pages,
            uniform_q_lens=(1,) if speculative is None else (1, speculative.num_speculative_tokens + 1),
            cascade=config.enable_cascade_attn,
        )
        self._ids = itertools.count()
        # LLM(seed=...): the random keys of requests without a seed of their own come from this
        # generator, so that a run is reproducible as a whole (vLLM's engine seed).
        self._seeds = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        self.requests: dict[int, Sequence] = {}
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (recomputes included)
        self.num_generated_tokens = 0
        self.memory_use = use
        logger.info("%s", self.describe_load(num_pages))
        reason = self._eager_reason()
        # async_scheduling: steps launched before the previous one's tokens are read (run_ahead.py);
        # by default wherever it can run (EngineConfig refuses True with speculation or several processes)
        run_ahead = config.async_scheduling
        if run_ahead is None:
            run_ahead = reason is None and speculative is None and config.tensor_parallel_size == 1
        if reason is None:
            self.runner.enable_graphs(
                batch_size_buckets(config.max_num_seqs),
                capture=True,
                lazy=config.lazy_graph_capture,
                feed=run_ahead,
            )
        logger.info("engine: %s", describe(self.runner.graphs, config.device, reason))
        if config.piecewise_graphs:
            why = self._piecewise_reason(reason)
            if why is None:
                buckets = piecewise.buckets_for(config.max_num_batched_tokens, config.piecewise_max_tokens)
                self.runner.enable_piecewise(capture=True, token_buckets=buckets)
            else:
                logger.warning("engine: piecewise_graphs=True but eager steps run eagerly: %s", why)
        self.run_ahead = None
        if run_ahead and self.runner.graphs is not None:
            self.run_ahead = RunAhead(self)
            logger.info("engine: async scheduling: steps launched before the previous step's tokens are read")
        elif run_ahead:
            logger.warning("engine: async_scheduling=True but it is off: it needs captured decode steps (%s)", reason)
        self.speculator = None  # speculative decoding: rank 0 proposes and verifies, the other ranks run its steps
        if speculative is not None and tp.rank == 0:
            self.speculator = build_speculator(speculative, self, draft, capture_graphs=reason is None)
            self.runner.verifier = self.speculator.verify
        self.warm_up()

    def describe_load(self, num_pages: int) -> str:
        """The start-up line: model, device, dtype, KV-cache tokens and how many requests of
        ``max_model_len`` tokens fit at once (vLLM's "maximum concurrency")."""
        config, tokens = self.config, num_pages * self.config.page_size
        kv = str(config.kv_cache_dtype).removeprefix("torch.")
        return (
            f"loaded {config.model} on {config.device} in {str(config.dtype).removeprefix('torch.')}: "
            f"KV cache {tokens:,} tokens ({num_pages} pages of {config.page_size}, {kv}), maximum concurrency "
            f"{tokens / self.max_model_len:.2f}x for {self.max_model_len}-token requests (max_model_len); attention "
            f"backend {self.backend.name}, {config.max_num_batched_tokens} tokens per step"
            + (
                f" (prompt chunks of at most {config.long_prefill_token_threshold} where the step has room"
                + (f", {n} left unfinished a step at most" if (n := config.max_num_partial_prefills) else "")
                + ")"
                if config.long_prefill_token_threshold
                else ""
            )
        )

    def _eager_reason(self) -> str | None:
        """Why decode steps run eagerly (None: they replay captured graphs)."""
        if self.config.enforce_eager:
            return "enforce_eager"
        if graph_support(self.config.device) is None:
            return f"torch has no graphs for device type {self.config.device.type!r}"
        if not self.backend.supports_graphs:
            return f"the {self.backend.name} backend has no graph plan"
        return None

    def _piecewise_reason(self, eager_reason: str | None, kv_pool: bool = True) -> str | None:
        """Why eager steps cannot run in captured pieces here (None: they can); ``kv_pool`` False:
        before the pool exists (its kind not asked)."""
        if eager_reason is not None:
            return eager_reason
        if graph_support(self.config.device) != "cuda":
            return f"captured pieces need CUDA graphs, got device type {self.config.device.type!r}"
        if self.config.tensor_parallel_size > 1:
            return "one process only (tensor_parallel_size 1)"
        if kv_pool and not self.kv_pool.cascades:  # (the kinds whose layers attend through the backend's attend)
            return "the model's cache kind plans its attention apart from the backend's attend"
        return piecewise.unsupported(self.model)

    def warm_up(self) -> None:
        """Capture the decode graphs and compile the kernels the model uses (GPU), with a progress bar.

        On a CUDA device with Triton, the kernels of what follows are first compiled in parallel by a
        rehearsal in which none runs (:meth:`_compile_ahead`). Every decode shape (batch size,
        uniform_q_len) is planned and captured (its kernels compiled first; with
        ``lazy_graph_capture`` a shape is captured when a step first needs it); then a few throw-away
        prompts (long, short, one token) are prefilled and decoded, so that the first requests find
        their prefill kernels compiled, and the LM head runs at every count of sampled rows a step can
        have (:meth:`ModelRunner.warm_logits`: the device loads each of its kernels here, not in a
        request's step). Logs how long each part took.
        """
        graphs, pieces = self.runner.graphs, self.runner.piecewise
        prompts = [n for n in WARM_UP_PROMPTS if n < self.max_model_len - 2] if is_gpu(self.config.device) else []
        if not prompts and graphs is None and pieces is None:
            return
        start = time.perf_counter()
        steps = len(prompts) + bool(prompts) + (len(graphs.shapes) if graphs is not None else 0)
        steps += len(pieces.buckets) if pieces is not None else 0
        if self.speculator is not None:  # the other ranks warm up without it: every rank runs the same steps
            self.speculator.paused = True
        rehearsed = self._compile_ahead(graphs, prompts)
        with tqdm(total=steps, desc="warm-up", unit="step", disable=None) as bar:
            if graphs is not None:
                graphs.capture_all(progress=lambda _: bar.update(1))
            if pieces is not None:
                pieces.capture_all(progress=lambda _: bar.update(1))
                logger.info("engine: %s", piecewise.describe(pieces))
            captured = time.perf_counter() - start
            for i, length in enumerate(prompts):
                self._warm_up_prompt(i, length, max_tokens=2)
                bar.update(1)
            head = time.perf_counter()
            if prompts:  # (on a GPU)
                self.runner.warm_logits(self.config.max_num_seqs)
                bar.update(1)
            head = time.perf_counter() - head
        if is_gpu(self.config.device):
            from ..kernels.triton.compile_ahead import log_late_compiles

            log_late_compiles()
        self.pages.num_cached_tokens = 0  # the engine's counters start at the first real request
        self.num_prompt_tokens_computed = self.num_generated_tokens = 0
        if self.speculator is not None:
            self.speculator.paused = False
        shapes = len(graphs.shapes) if graphs is not None else 0
        if graphs is not None and graphs.capture:
            done = f"{graphs.num_captured} graphs captured" + (" (lazily)" if graphs.lazy else "")
        else:
            done = "planned"
        logger.info(
            "warm-up: %.1f s (%sdecode shapes: %d %s in %.1f s; %d warm-up prompts in %.1f s%s)",
            time.perf_counter() - start,
            "" if rehearsed is None else f"kernels compiled ahead in {rehearsed:.1f} s; ",
            shapes,
            done,
            captured - (rehearsed or 0.0),
            len(prompts),
            time.perf_counter() - start - captured - head,
            f"; the LM head at 1 to {self.config.max_num_seqs} rows in {head:.2f} s" if prompts else "",
        )

    def _warm_up_prompt(self, index: int, length: int, max_tokens: int) -> None:
        """Prefill a throw-away prompt of ``length`` tokens and decode it to ``max_tokens`` tokens."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.scheduler.add(Sequence(-1 - index, [0] * length, params))
        while self.scheduler.has_unfinished():
            self.step()
        self.pages.clear_cache()  # the next prompt must not hit this one's pages

    def _compile_ahead(self, graphs, prompts: list[int]) -> float | None:
        """Compile the warm-up's Triton kernels in parallel (``kernels/triton/compile_ahead.py``): a
        rehearsal of the decode shapes recorded at start and of the warm-up prompts' prefills in which
        no Triton kernel runs (their values are thrown away: the prompts' pages are dropped, the
        graphs' inputs rewritten before each capture). Returns its seconds, None where it does not
        apply (no Triton, or not on a CUDA device)."""
        from ..kernels.triton.compile_ahead import compile_ahead

        start = time.perf_counter()
        with compile_ahead(self.config.device) as rehearsing:
            if not rehearsing:
                return None
            if graphs is not None:  # a graph recorded now would hold none of the Triton kernels
                graphs.rehearsing = True
            try:
                if graphs is not None and graphs.capture:
                    graphs.rehearse(graphs.start_shapes())
                for bucket in () if self.runner.piecewise is None else self.runner.piecewise.buckets:
                    with contextlib.suppress(piecewise.NotPiecewise):  # (such a bucket is skipped at its capture)
                        self.runner.piecewise.warm(bucket)
                for i, length in enumerate(prompts):
                    # The prefill alone (a one-token prompt's step is the decode graph's shape, run eagerly).
                    self._warm_up_prompt(i, length, max_tokens=1)
                if prompts:
                    self._rehearse_mixed_steps()
            finally:
                if graphs is not None:
                    graphs.rehearsing = False
        return time.perf_counter() - start

    def _rehearse_mixed_steps(self) -> None:
        """Under :meth:`_compile_ahead`: one forward of each mixed step of :data:`MIXED_DECODES` x
        :data:`MIXED_CONTEXTS` and of :data:`MIXED_CHUNKS` that the request slots, ``max_model_len`` and
        the pool allow, over pages reserved for it and given back (nothing computed: the decodes' and the
        chunk's cached tokens are only counted as such)."""
        steps = [([c] * d, (MIXED_DECODE_CHUNK, 0)) for d in MIXED_DECODES for c in MIXED_CONTEXTS]
        steps += [([MIXED_CONTEXTS[0]], chunk) for chunk in MIXED_CHUNKS]
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for contexts, (chunk, cached) in steps:
            if len(contexts) + 1 > self.config.max_num_seqs or max(*contexts, cached + chunk) > self.max_model_len:
                continue
            shape = [(context, 1) for context in contexts] + [(cached + chunk, chunk)]
            seqs = [Sequence(-100 - i, [0] * length, params) for i, (length, _) in enumerate(shape)]
            try:
                if all(self._hold(seq, length) for seq, (length, _) in zip(seqs, shape)):
                    for seq, (length, n) in zip(seqs, shape):
                        seq.num_computed = length - n
                    self.runner.forward([(seq, n) for seq, (_, n) in zip(seqs, shape)], rows=[])
            finally:
                for seq in seqs:
                    self.pages.release_all(seq)
                self.pages.clear_cache()

    def _hold(self, seq: Sequence, num_tokens: int) -> bool:
        """A request row and pages for ``num_tokens`` tokens of ``seq`` (False: the pool is short)."""
        seq.req_pool_idx = self.pages.req_pool.alloc()
        return self.pages.reserve(seq, num_tokens)

    def add_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        multimodal: MultimodalData | None = None,
        *,
        index: int = 0,
        added: list[Sequence] | None = None,
    ) -> Sequence:
        """Queue one sequence: choice ``index`` of a request (its random stream is keyed by
        ``(params.seed, index)``, or drawn from the engine's ``seed`` when the request has none; the
        caller expands a request into its ``params.num_seqs`` sequences). The prompt is truncated as
        ``params.truncate_prompt_tokens`` says, and the sampling fields ``params`` leaves unset take
        :attr:`sampling_defaults`.

        ``added``: a list the sequence is appended to in the same all-or-nothing step that queues it,
        so that a caller interrupted between two requests knows exactly what to abort."""
        token_ids = self.prepare_prompt(token_ids, params, multimodal)
        self.check_params(params)
        params = params.with_defaults(self.sampling_defaults)
        if params.seed is None and self._seeds is not None:
            key = int(torch.randint(0, 2**62, (), generator=self._seeds))
        else:
            key = sample_key(params.seed, index)
        seq = Sequence(next(self._ids), list(token_ids), params, key, index, multimodal=multimodal)
        if params.bad_words:
            seq.bad_word_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params)
        try:
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)
            if added is not None:
                added.append(seq)
        except BaseException:  # known, queued and recorded, or none of them
            if added is None or seq not in added:
                self.requests.pop(seq.request_id, None)
                if seq in self.scheduler.waiting:
                    self.scheduler.waiting.remove(seq)
            raise
        return seq

    def check_params(self, params: SamplingParams) -> None:
        """What the parameters ask that this model cannot give raises ``ValueError``."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"expected stop_token_ids below the vocabulary size {self.vocab_size}, got {bad}")
        if params.stop and self.tokenizer is None:
            raise ValueError("expected no stop strings: the model directory has no tokenizer, got stop")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("expected no bad_words: the model directory has no tokenizer, got bad_words")
        bad = [t for t in params.allowed_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"expected allowed_token_ids below the vocabulary size {self.vocab_size}, got {bad}")

    def prepare_prompt(
        self, token_ids: list[int], params: SamplingParams, multimodal: MultimodalData | None = None
    ) -> list[int]:
        """The prompt as ``params.truncate_prompt_tokens`` keeps it, checked (:meth:`check_prompt`).
        A prompt with images is not truncated (its image tokens must stay whole): refused if it would be."""
        kept = params.truncate(token_ids, self.max_model_len)
        if multimodal is not None and len(kept) < len(token_ids):
            raise ValueError(
                f"expected truncate_prompt_tokens to keep the whole of a prompt with images ({len(token_ids)} "
                f"tokens), got {params.truncate_prompt_tokens}"
            )
        self.check_prompt(kept)
        return kept

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("expected a prompt of at least one token, got an empty prompt")
        if all_ints(token_ids) and min(token_ids) >= 0 and max(token_ids) < self.vocab_size:
            bad = None  # a long prompt is checked in three passes in C (the loop below takes 1 us a token)
        else:
            bad = next((i for i, t in enumerate(token_ids) if not (is_int(t) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(
                f"expected token ids in [0, {self.vocab_size}) (ints), got {token_ids[bad]!r} at index {bad}"
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"expected a prompt shorter than max_model_len {self.max_model_len}, got {len(token_ids)} tokens"
            )

    def abort(self, request_id: int) -> None:
        """Stop an unfinished request now; its pages and request slot go back to the pools."""
        if request_id not in self.requests:
            raise ValueError(f"expected the id of an unfinished request, got {request_id}")
        self.scheduler.finish(self.requests.pop(request_id), "abort")
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward; returns the sequences that finished in it (none, and no forward, when no
        request is unfinished). With ``async_scheduling``, the sequences that finished with the tokens
        it read, which a step launched by the previous call sampled (``run_ahead.py``).

        If the forward or its updates raise (an interrupt, ``MemoryError``), the step's unfinished
        sequences are aborted before the exception propagates: their half-applied step cannot be
        resumed, and their pages and request rows go back to the pools.
        """
        if self.run_ahead is not None:
            return self.run_ahead.step()
        speculator = self.speculator
        if speculator is not None:
            speculator.before_schedule(self.scheduler)
        scheduled = self.scheduler.schedule()
        if not scheduled:  # nothing unfinished (a pool that cannot run what is has raised)
            return []
        return self.run_step(scheduled)

    def run_step(self, scheduled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """:meth:`step` from its schedule: the forward, the sampled tokens appended, the stops."""
        speculator = self.speculator
        try:
            if speculator is not None:
                scheduled = speculator.propose(scheduled, self.scheduler.running)

            def computed() -> None:  # needs no sampled token: runs while the device samples, where it can
                self.mark_computed(scheduled)

            if self.parallel is not None:
                sampled = self.parallel.step(self.runner, scheduled, set(self.requests), computed)
            else:
                sampled = self.runner.step(scheduled, while_running=computed)
            finished = []
            for seq, (tokens, logprobs) in sampled.items():
                verified = seq.num_draft_tokens > 0
                if verified:
                    speculator.accept(seq, tokens)
                reason = self.append_tokens(seq, tokens, logprobs)
                if verified:
                    speculator.settle(seq)
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
            if speculator is not None and finished:
                speculator.release(self.scheduler.running)
        except BaseException:
            if speculator is not None:
                speculator.discard(scheduled)
            for seq, _ in scheduled:
                if seq.status is Status.FINISHED:
                    self.requests.pop(seq.request_id, None)
                elif seq.request_id in self.requests:
                    self.abort(seq.request_id)
            raise
        return finished

    def mark_computed(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The K/V of the scheduled tokens are (being) computed: counts advanced and full pages committed
        to the prefix cache (a sequence with proposed tokens commits once they are verified)."""
        for seq, n in scheduled:
            prompt_end = min(seq.num_computed + n, seq.num_prompt_tokens)
            self.num_prompt_tokens_computed += max(0, prompt_end - seq.num_computed)
            seq.num_computed += n
            if not seq.num_draft_tokens:
                self.pages.commit(seq)

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list | None) -> str | None:
        """Append a step's sampled ``tokens`` (more than one: accepted proposals, then the verifier's
        token) to ``seq`` until one stops it; returns why it stops (None: it goes on)."""
        reason = None
        for i, token in enumerate(tokens):
            if i:  # the previous token was an accepted proposal: its K/V are computed
                seq.num_computed += 1
            seq.token_ids.append(token)
            self.num_generated_tokens += 1
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            reason = self._finish_reason(seq, token)
            if reason is not None:
                break  # what follows a stop is dropped, as plain decoding never makes it
        return reason

    def at_length(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether ``seq`` stops for its length with ``ahead`` more tokens (``max_model_len`` or
        ``max_tokens`` reached)."""
        limit = seq.params.max_tokens
        return seq.num_tokens + ahead >= self.max_model_len or (
            limit is not None and seq.num_output_tokens + ahead >= limit
        )

    def finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` stopped after its last token for ``reason``: its text flushed, its pages released."""
        if seq.detokenizer is not None:
            seq.detokenizer.flush()
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)

    def call(self, fn, *args):
        """``fn(self, *args)``, on every rank under tensor parallelism (``fn`` a module-level function
        whose collectives every rank makes); returns this rank's result."""
        if self.parallel is None:
            return fn(self, *args)
        return self.parallel.call(self, fn, *args)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for one process)."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` stops after ``token`` (None: it goes on); updates its text and ``stop_reason``."""
        params, detok = seq.params, seq.detokenizer
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            seq.stop_reason = token if token in params.stop_token_ids else None
            if detok is not None and params.include_stop_str_in_output:
                detok.append(token)
            return "stop"
        if detok is not None:
            grown = detok.append(token)
            if params.stop and seq.num_output_tokens > params.min_tokens:
                seq.stop_reason = detok.find_stop(grown)
                if seq.stop_reason is not None:
                    return "stop"
        if self.at_length(seq):
            return "length"
        return None
