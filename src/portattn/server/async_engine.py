"""An asyncio front over the engine: one thread owns the engine and steps it; requests are added and
aborted while it runs, through a queue it drains before every step; each step's new tokens go to
their HTTP handlers' asyncio queues.

The engine is not thread-safe, so every call into it (add, abort, step) happens on that thread.
Handlers only read finished sequences and the statistics snapshot the thread publishes after each step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..engine.engine import Engine
from ..engine.input_processor import InputProcessor
from ..engine.outputs import RequestOutput, RequestState
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Status
from ..engine.spec_decode.speculator import SpecDecodeStats
from ..runtime.multimodal import MultimodalData

logger = logging.getLogger("portattn")

# The engine thread and the event loop share the GIL, and a thread that asks for it gets it only once the
# holder has run for the switch interval (Python's default: 5 ms). Back from waiting for the device, the
# engine thread could so wait up to 5 ms while the event loop streamed the last step's tokens, and the step
# after the launched one started that much later. While serving the interval is at most this. On one H200
# (Llama-3-8B shape, Poisson 16 requests a second, a budget of 256 tokens, pieces), three servers in turn:
# ITL p99 8.7 / 11.8 / 10.8 ms (1.7x / 2.3x / 2.1x the median), the middle one with the default interval
# (benchmarks/results/engine_h200/round26/NOTES.md); the engine alone, in one process, 1.6-1.7x.
SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval() -> None:
    """Set the GIL's switch interval to :data:`SWITCH_INTERVAL_S` where it is longer: in the process of the
    engine's thread, and in the server's process when the engine has its own (there the thread that hands each
    step's tokens to the event loop asks for the GIL the same way)."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


# A file to write the engine thread's loop to at shutdown (JSON): each step's time draining the requests added
# (and how many), stepping, handing the tokens out and publishing the statistics, with the sequences running and
# waiting, and each idle wait; for finding where a server's stall went (the engine's own process included).
STEP_TRACE_ENV = "PORTATTN_STEP_TRACE"


@dataclass(frozen=True)
class Prompt:
    """One engine request's input: its text (None for token ids), token ids and images."""

    text: str | None
    token_ids: list[int]
    multimodal: MultimodalData | None = None


@dataclass(frozen=True)
class EngineStats:
    """What ``/metrics`` reports about the engine, as of the last step."""

    running: int = 0  # sequences scheduled
    waiting: int = 0  # sequences queued (preempted ones included)
    waiting_requests: int = 0  # requests none of whose sequences has started, not yet-to-be-added ones
    pages_used: int = 0  # held by sequences or the prefix cache
    pages_free: int = 0
    pages_evictable: int = 0  # of the used, those only the prefix cache holds (reusable at once)
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    queried_prompt_tokens: int = 0  # prompt tokens of the sequences added
    preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens run through the model (recomputed ones included)
    generation_tokens: int = 0
    steps: int = 0
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters, when the engine speculates
    engine_cpu_s: float = 0.0  # the engine thread's CPU time (time.thread_time) as of the last step
    requests_added: int = 0  # requests the engine's loop has taken (an engine in its own process counts them)


class RequestStream:
    """One HTTP request's engine requests (one per prompt): yields ``(prompt index, delta output)``
    as steps produce them, until every prompt's request has finished.

    A reader that has not taken the last delta yet is :attr:`behind`: the engine thread then leaves the
    unfinished prompts' new tokens for the next delta, which carries all of them (as vLLM merges the
    outputs a slow reader has not taken). Under load the event loop sends one chunk of several tokens
    where it would fall further behind sending one chunk a token."""

    def __init__(self, async_engine: AsyncEngine, request_id: str, num_prompts: int):
        self.engine = async_engine
        self.request_id = request_id
        self.states: list[RequestState] = []  # one per prompt, made on the engine thread
        self.num_prompts = num_prompts
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.pushed = 0  # items pushed: written by the engine thread only
        self.taken = 0  # items the reader took: written by the event loop only

    @property
    def behind(self) -> bool:
        """Whether an item pushed has not been taken by the reader yet."""
        return self.pushed > self.taken

    def push(self, item) -> None:  # engine thread
        self.pushed += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = self.num_prompts
        while remaining:
            for item in await self._take():
                if isinstance(item, BaseException):
                    raise item
                index, out = item
                if out.finished:
                    remaining -= 1
                yield index, out
        self.finished = True

    async def _take(self) -> list:
        """The next items for the reader (one here: the engine thread merges a slow reader's deltas)."""
        item = await self.queue.get()
        self.taken += 1
        return [item]

    def abort(self) -> None:
        """Abort what is unfinished (at the engine thread's next turn: pages go back before its next step)."""
        if not self.finished:
            self.engine.abort(self.request_id)

    def fail(self, error: BaseException) -> None:
        """End the stream from the event loop: its reader raises ``error``; the engine drops the request."""
        if not self.finished:
            self.queue.put_nowait(error)
            self.abort()


class AsyncEngine:
    """Owns ``engine`` on a thread started by :meth:`start`; ``max_queue`` bounds the requests waiting."""

    def __init__(self, engine: Engine, *, max_queue: int | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._pending = 0  # requests submitted, not yet added by the engine thread
        self._pending_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._queried = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.error: BaseException | None = None
        # Token texts for log-probabilities, made on the engine thread with the engine's tokenizer
        # (a tokenizer is not shared between threads).
        self._texts = InputProcessor(engine.model, engine.tokenizer, engine.config.model)
        self._trace_path = os.environ.get(STEP_TRACE_ENV) or None
        self._trace: list[dict] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (and shorten the GIL's switch interval: :func:`shorten_switch_interval`)."""
        shorten_switch_interval()
        self._thread = threading.Thread(target=self._run, name="portattn-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread after its current step, then the engine (its other tensor-parallel ranks)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.alive:  # still in a step: the ranks stop at interpreter exit instead
            logger.warning("the engine thread did not stop within 30 s")
            return
        if self._trace_path is not None:
            with open(self._trace_path, "w") as f:
                json.dump({"steps": self._trace}, f)
            logger.info("step trace: %d entries written to %s", len(self._trace), self._trace_path)
        self.engine.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- front (event loop) ------------------------------------------------------------------

    def queue_full(self) -> bool:
        if self.max_queue is None:
            return False
        with self._pending_lock:
            pending = self._pending
        return self.stats.waiting_requests + pending >= self.max_queue

    def submit(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> RequestStream:
        """Queue one engine request per prompt; their outputs come on the stream."""
        stream = RequestStream(self, request_id, len(prompts))
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(("add", stream, prompts, params))
        self._wake.set()
        if self.error is not None:  # the thread died meanwhile and may have drained its inbox already
            stream.fail(self._failure())
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as err:  # the engine is broken: fail every request and stop taking new ones
            logger.exception("the engine failed")
            self.error = err  # set before the inbox is drained: a later submit sees it (see submit)
            failure = self._failure()
            for stream in self._streams.values():
                stream.push(failure)
            self._streams.clear()
            while True:  # requests submitted but not yet added would otherwise wait forever
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if msg[0] == "add":
                    msg[1].push(failure)

    def _failure(self) -> RuntimeError:
        return RuntimeError(f"the engine failed: {type(self.error).__name__}: {self.error}")

    def _loop(self) -> None:
        engine = self.engine
        trace = self._trace if self._trace_path is not None else None
        clock = time.perf_counter
        while not self._stop:
            start = clock()
            added = self._drain()
            if not engine.has_unfinished():
                self._publish()
                self._wake.wait()
                self._wake.clear()
                if trace is not None:
                    trace.append({"t": start, "added": added, "idle_ms": (clock() - start) * 1e3})
                continue
            drained = clock()
            prompt_tokens = engine.num_prompt_tokens_computed
            engine.step()
            stepped = clock()
            self._emit()
            emitted = clock()
            self._publish()
            if trace is not None:
                trace.append({
                    "t": start, "added": added, "drain_ms": (drained - start) * 1e3,
                    "step_ms": (stepped - drained) * 1e3, "emit_ms": (emitted - stepped) * 1e3,
                    "publish_ms": (clock() - emitted) * 1e3, "running": len(engine.scheduler.running),
                    "waiting": len(engine.scheduler.waiting),
                    "prompt_tokens": engine.num_prompt_tokens_computed - prompt_tokens,
                })  # fmt: skip

    def _drain(self) -> int:
        """Add and abort what was submitted since the last step; returns the requests added."""
        added = 0
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return added
            if msg[0] == "add":
                _, stream, prompts, params = msg
                with self._pending_lock:
                    self._pending -= 1
                self._add(stream, prompts, params)
                added += 1
            else:
                self._abort(msg[1])

    def _add(self, stream: RequestStream, prompts: list[Prompt], params: SamplingParams) -> None:
        self._streams[stream.request_id] = stream  # first: an engine failure below reaches it (_run)
        added = []
        try:
            for i, prompt in enumerate(prompts):
                seqs = []
                for j in range(params.num_seqs):
                    seqs.append(self.engine.add_request(prompt.token_ids, params, prompt.multimodal, index=j))
                    added.append(seqs[-1])
                stream.states.append(
                    RequestState(f"{stream.request_id}-{i}", prompt.text, seqs, self._texts.token_text)
                )
                self._queried += len(prompt.token_ids) * params.num_seqs
        except ValueError as err:  # the handler checked already: nothing else to blame
            for seq in added:
                self.engine.abort(seq.request_id)
            del self._streams[stream.request_id]
            stream.push(err)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        for state in stream.states:
            for seq in state.seqs:
                if seq.request_id in self.engine.requests:
                    self.engine.abort(seq.request_id)

    def _emit(self) -> None:
        """Each stream's new tokens as one delta, handed to the event loop in one call a step (a call
        each would wake the loop once a stream, and each wake-up contends for the GIL with this thread
        before it has launched the next step)."""
        done, items = [], []
        for request_id, stream in self._streams.items():
            behind = stream.behind
            for i, state in enumerate(stream.states):
                if behind and not state.finished:  # the next delta carries this step's tokens too
                    continue
                out = state.output(delta=True)
                if out is not None:
                    stream.pushed += 1
                    items.append((stream, (i, out)))
            if all(state.finished for state in stream.states):
                done.append(request_id)
        for request_id in done:
            del self._streams[request_id]
        loops: dict = {}
        for stream, item in items:
            loops.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in loops.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _publish(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        waiting_requests = sum(
            all(seq.status is Status.WAITING and len(seq.token_ids) == seq.num_prompt_tokens for seq in state.seqs)
            for stream in self._streams.values()
            for state in stream.states
        )
        self.stats = EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            waiting_requests=waiting_requests,
            pages_used=engine.allocator.num_used,
            pages_free=engine.allocator.num_free,
            pages_evictable=engine.allocator.num_evictable,
            cached_prompt_tokens=engine.pages.num_cached_tokens,
            queried_prompt_tokens=self._queried,
            preemptions=scheduler.num_preemptions,
            prompt_tokens=engine.num_prompt_tokens_computed,
            generation_tokens=engine.num_generated_tokens,
            steps=self.stats.steps + 1,
            spec_decode=engine.speculator.stats.snapshot() if engine.speculator is not None else None,
            engine_cpu_s=time.thread_time(),
        )


def _put_all(puts: list) -> None:  # event loop
    for queue_, item in puts:
        queue_.put_nowait(item)
