"""The engine in a process of its own behind the server (``portattn serve``'s default on a GPU for a text
model; ``--engine-process`` / ``--no-engine-process``).

In one process the engine's thread and the event loop share the GIL: every streamed chunk is a few
callbacks and a socket write on the loop (40-65 us a chunk through uvicorn on the CPU machine), and on an
H200 at Poisson 16 requests a second the loop took 12-14% of a core beside an engine thread at 75-90%,
whose next launch then waits for the GIL (benchmarks/results/engine_h200/round28/NOTES.md). vLLM and
SGLang run the engine core in a process of its own for this reason. Here the process runs the engine and
its step loop (the same :class:`~.async_engine.AsyncEngine` loop, with each stream's deltas sent over a
pipe once a step), and the server's process keeps the HTTP side: :class:`EngineProcess` has
:class:`AsyncEngine`'s interface (submit, abort, stats, start, shutdown, the engine's limits and checks
through :class:`EngineFacade`).

The engine's process registers the model architectures and attention backends registered in the server's
(``--register``, ``register_model``, ``register_backend``), which must live in importable modules.

What differs from the engine on a thread: text models only (a model that takes images is refused: its
inputs are built with the model's own code); the engine sends every step's delta, and a reader that falls
behind takes what queued for it merged, one delta per prompt (:func:`merge_queued`; the thread's engine
leaves a slow reader's tokens for its next delta instead). The process is started with
``multiprocessing``'s spawn: a script that builds the app itself needs the ``if __name__ == "__main__"``
guard, as vLLM's do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import operator
import queue
import signal
import threading
import time
import traceback

import torch

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.outputs import CompletionOutput, RequestOutput, RequestState
from ..engine.parallel.driver import registrations
from .async_engine import AsyncEngine, Prompt, RequestStream, _put_all, shorten_switch_interval

logger = logging.getLogger("portattn")

STATS_INTERVAL_S = 0.05  # the engine's statistics are sent at most this often (and once a step after a pause)


def refuse_multimodal(config: EngineConfig) -> None:
    """A model that takes images has its inputs built by the model's own code, which lives in the engine's
    process: refused with the way to serve it."""
    from ..models import loader
    from ..models.base import MultimodalModel

    cls = loader.model_class(getattr(loader.load_config(config.model), "architectures", None))
    if issubclass(cls, MultimodalModel):
        raise ValueError(
            f"expected a text model for --engine-process (engine_process=True), got {cls.__name__}, which takes "
            "images: serve it without --engine-process"
        )


class EngineFacade:
    """What the server's handlers ask of the engine, answered in the server's process: its configuration,
    ``max_model_len``, ``vocab_size``, the tokenizer (the server's own) and the checks of prompts and
    parameters (the engine's own code over these values)."""

    check_params = Engine.check_params
    check_prompt = Engine.check_prompt

    def __init__(self, info: dict):
        self.config: EngineConfig = info["config"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.model = type(info["model_class"], (), {})()  # a stand-in: handlers read only its class
        self.tokenizer = None  # the server's, set once it is loaded (create_app)


def _extend_choices(choices: dict[int, CompletionOutput], deltas: list[CompletionOutput]) -> None:
    """Each delta's new text, tokens, log-probabilities and logits appended to its choice in ``choices`` (by
    index; a copy made at the first), its latest cumulative log-probability and finish kept."""
    for c in deltas:
        kept = choices.get(c.index)
        if kept is None:
            choices[c.index] = dataclasses.replace(
                c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs)
            )
            continue
        kept.text += c.text
        kept.token_ids += c.token_ids
        if c.logprobs is not None:
            kept.logprobs = (kept.logprobs or []) + c.logprobs
        if c.logits is not None:
            kept.logits = c.logits if kept.logits is None else torch.cat([kept.logits, c.logits])
        kept.cumulative_logprob = c.cumulative_logprob
        kept.finish_reason, kept.stop_reason = c.finish_reason, c.stop_reason


def merge_queued(items: list) -> list:
    """The items a reader finds queued, each prompt's deltas merged into one (in the order its first came;
    its choices by index, the first's prompt log-probabilities, the last's ``finished``), as the engine
    thread merges what a slow reader has not taken; an error ends the list after what came before it."""
    merged: dict[int, tuple] = {}  # prompt index -> (first delta, choices merged, last delta, deltas)
    error = None
    for item in items:
        if isinstance(item, BaseException):
            error = item
            break
        index, out = item
        first, choices, _, count = merged.get(index, (out, {}, None, 0))
        _extend_choices(choices, out.outputs)
        merged[index] = (first, choices, out, count + 1)
    taken: list = []
    for index, (first, choices, last, count) in merged.items():
        if count > 1:
            outputs = [choices[i] for i in sorted(choices)]
            last = dataclasses.replace(
                last, outputs=outputs, prompt_logprobs=first.prompt_logprobs, prompt_logits=first.prompt_logits
            )
        taken.append((index, last))
    return taken if error is None else [*taken, error]


class _MergingStream(RequestStream):
    """A request's stream on the server's side of an engine process: the engine there sends every step's delta
    (it cannot see this reader), so a reader that fell behind takes all that queued at once, merged."""

    async def _take(self) -> list:
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        self.taken += len(items)
        return merge_queued(items)


_CHOICE_VALUES = operator.attrgetter(*(f.name for f in dataclasses.fields(CompletionOutput)))


def encoded(out: RequestOutput, with_prompt: bool) -> tuple:
    """A delta as plain values for the pipe (each choice's fields in :class:`CompletionOutput`'s order): a
    tenth of the time to unpickle that the dataclasses took (256 one-token deltas: 0.3 ms against 2.3 ms on
    the CPU machine, where the server's receiver holds its GIL). Without the prompt's text and token ids
    (``with_prompt`` False: the prompt's later deltas), which were 98% of the bytes of a step's deltas for
    prompts of 768 tokens (110 KB for 16 of them)."""
    prompt, prompt_ids = (out.prompt, out.prompt_token_ids) if with_prompt else (None, None)
    choices = [_CHOICE_VALUES(c) for c in out.outputs]
    return out.request_id, prompt, prompt_ids, choices, out.finished, out.prompt_logprobs, out.prompt_logits


def decoded(values: tuple, previous: RequestOutput | None) -> RequestOutput:
    """The delta :func:`encoded` gave, its prompt from the ``previous`` delta of the same prompt where it came
    without."""
    request_id, prompt, prompt_ids, choices, finished, prompt_logprobs, prompt_logits = values
    if prompt_ids is None:
        prompt, prompt_ids = previous.prompt, previous.prompt_token_ids
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        outputs=[CompletionOutput(*c) for c in choices],
        finished=finished,
        prompt_logprobs=prompt_logprobs,
        prompt_logits=prompt_logits,
    )


class CollectedOutput:
    """A prompt's whole output on the server's side, merged from the deltas the engine sent: what the handlers
    of whole (not streamed) responses read of a :class:`~portattn.engine.outputs.RequestState` (its
    :meth:`output`, and its choices' token counts as ``seqs``)."""

    def __init__(self, params):
        self.params = params
        self.last: RequestOutput | None = None
        self.prompt_logprobs = self.prompt_logits = None
        self.choices: dict[int, CompletionOutput] = {}

    def add(self, out: RequestOutput) -> None:
        self.last = out
        if self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.prompt_logits is None:
            self.prompt_logits = out.prompt_logits
        _extend_choices(self.choices, out.outputs)

    def output(self) -> RequestOutput:
        outputs = [dataclasses.replace(self.choices[i]) for i in sorted(self.choices)]
        if self.params.num_seqs > self.params.n:  # best_of: the n likeliest, as the engine's whole output
            outputs = RequestState._best(outputs, self.params.n)
        last = self.last
        return RequestOutput(
            request_id=last.request_id,
            prompt=last.prompt,
            prompt_token_ids=last.prompt_token_ids,
            outputs=outputs,
            finished=last.finished,
            prompt_logprobs=self.prompt_logprobs,
            prompt_logits=self.prompt_logits,
        )

    @property
    def seqs(self) -> list:
        return [_Counted(len(c.token_ids)) for c in self.choices.values()]


@dataclasses.dataclass(frozen=True)
class _Counted:
    num_output_tokens: int


# What the engine's start-up raises for bad input, raised again as itself in the server's process (its message
# says what was expected), as the engine built on a thread raises it.
_INPUT_ERRORS = {cls.__name__: cls for cls in (ValueError, TypeError, FileNotFoundError, NotADirectoryError, OSError)}


def _start_up_error(payload: tuple) -> Exception:
    """The exception of a failed start-up in the engine's process (its traceback logged at DEBUG)."""
    name, message, trace = payload
    logger.debug("the engine process's start-up failed:\n%s", trace)
    if name in _INPUT_ERRORS:
        return _INPUT_ERRORS[name](message)
    return RuntimeError(f"the engine process failed to start: {name}: {message}")


class Outbox:
    """The server's messages to the engine's process, sent by a thread of their own: :meth:`put` never waits for
    the pipe, and each send is a list of every message queued since the previous send.

    A message a send costs the engine's reader one wake-up and one take of the GIL, which its step loop holds
    while it launches a step; a burst of requests sent one by one then fills the pipe and blocks the event loop
    (no stream gets a token meanwhile) until the reader has taken each. On a 2-core CPU, with a thread spinning in
    Python beside the reader, 255 requests of 1,024 token ids took 1.6-1.9 s one by one at Python's default switch
    interval and 38-48 ms as one list; at the engine process's 0.5 ms, 15.5 and 19 ms, the sender blocked 13.7 ms
    one by one (benchmarks/results/round39/scripts/pipe_burst.py). Here the event loop never waits on the pipe.
    Sending stops after ``stop`` or when the pipe breaks (the server's receiver then tells the streams why)."""

    def __init__(self, conn):
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="portattn-engine-sender", daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> bool:
        """Queue ``message``; False once sending has stopped."""
        if not self._thread.is_alive():
            return False
        self._queue.put(message)
        return True

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            try:
                self._conn.send(batch)
            except (OSError, EOFError, BrokenPipeError):
                return
            if any(message[0] == "stop" for message in batch):
                return


class EngineProcess:
    """:class:`AsyncEngine`'s interface over an engine built and stepped in a process of its own (spawned,
    waited for until its warm-up is done); ``max_queue`` bounds the requests waiting."""

    def __init__(self, config: EngineConfig, *, max_queue: int | None = None):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        level = logging.getLogger("portattn").getEffectiveLevel()
        registered = registrations("--engine-process (the engine's process imports it)")
        self._process = context.Process(
            target=_engine_main, args=(config, child, level, registered), name="portattn-engine", daemon=True
        )
        self._process.start()
        child.close()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(timeout=30)
            raise RuntimeError(
                f"the engine process exited during its start-up (exit code {self._process.exitcode})"
            ) from None
        if kind != "ready":
            self._process.join(timeout=30)
            raise _start_up_error(payload)
        self.engine = EngineFacade(payload)
        self.max_queue = max_queue
        try:
            kind, self.stats = self._conn.recv()  # the engine's first statistics follow its readiness
        except EOFError:
            kind = "nothing: it exited"
        if kind != "stats":
            raise RuntimeError(f"expected the engine process's first statistics after its start-up, got {kind!r}")
        self.error: BaseException | None = None
        self._streams: dict[str, list] = {}  # request id -> [stream, unfinished prompts]
        self._streams_lock = threading.Lock()
        self._submitted = 0
        self._stopping = False
        self._receiver: threading.Thread | None = None
        self._outbox = Outbox(self._conn)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start taking the engine's messages (the engine steps from its start-up on); the GIL's switch interval
        shortened as beside an engine thread (:func:`~.async_engine.shorten_switch_interval`)."""
        shorten_switch_interval()
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive, name="portattn-engine-receiver", daemon=True)
            self._receiver.start()

    def shutdown(self) -> None:
        """Stop the engine after its current step, then its process (killed after 30 s)."""
        self._stopping = True
        self._send(("stop",))
        self._outbox.join(timeout=30)
        self._process.join(timeout=30)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within 30 s; terminating it")
            self._process.terminate()
            self._process.join(timeout=10)
        if self._receiver is not None:
            self._receiver.join(timeout=5)

    @property
    def alive(self) -> bool:
        return self._receiver is not None and self._receiver.is_alive() and self.error is None

    # -- front (event loop) ------------------------------------------------------------------

    def queue_full(self) -> bool:
        if self.max_queue is None:
            return False
        pending = self._submitted - self.stats.requests_added
        return self.stats.waiting_requests + pending >= self.max_queue

    def submit(self, request_id: str, prompts: list[Prompt], params) -> RequestStream:
        """Send one engine request per prompt; their outputs come on the stream."""
        stream = _MergingStream(self, request_id, len(prompts))
        stream.states = [CollectedOutput(params) for _ in prompts]
        with self._streams_lock:
            self._streams[request_id] = [stream, len(prompts)]
        self._submitted += 1
        if self.error is not None or not self._send(("add", request_id, len(prompts), prompts, params)):
            self._forget(request_id)
            stream.fail(self._failure())
        return stream

    def abort(self, request_id: str) -> None:
        self._forget(request_id)  # (the engine sends nothing more of an aborted request)
        self._send(("abort", request_id))

    def _send(self, message: tuple) -> bool:
        return self._outbox.put(message)

    def _failure(self) -> RuntimeError:
        return RuntimeError(f"the engine failed: {self.error}")

    def _forget(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    # -- receiver thread ---------------------------------------------------------------------

    def _receive(self) -> None:
        while True:
            try:
                kind, *payload = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._process.join(timeout=1)
                    self._fail(RuntimeError(f"its process exited (exit code {self._process.exitcode})"))
                return
            if kind == "items":
                self._dispatch(payload[0])
            elif kind == "stats":
                self.stats = payload[0]
            elif kind == "failed":
                self._fail(RuntimeError(payload[0]))
                return

    def _dispatch(self, items: list) -> None:
        """A step's deltas (:func:`encoded`), each to its stream's queue, in one call on each event loop."""
        loops: dict = {}
        with self._streams_lock:
            for request_id, *sent in items:
                entry = self._streams.get(request_id)
                if entry is None:  # the request was given up by its handler
                    continue
                stream = entry[0]
                if len(sent) == 1:  # an error
                    item = sent[0]
                    del self._streams[request_id]
                else:
                    index, values = sent
                    state = stream.states[index]
                    item = (index, decoded(values, state.last))
                    state.add(item[1])  # (before the reader can see the item)
                    if item[1].finished:
                        entry[1] -= 1
                        if entry[1] == 0:
                            del self._streams[request_id]
                loops.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in loops.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _fail(self, error: BaseException) -> None:
        """The engine is gone: every open stream and every later request gets the error."""
        self.error = error
        logger.error("%s", error)
        with self._streams_lock:
            streams, self._streams = [entry[0] for entry in self._streams.values()], {}
        failure = self._failure()
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # its event loop closed meanwhile
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, failure)


# -- the engine's process ----------------------------------------------------------------------


class _Sender:
    """Stands in for an event loop on the engine's side: a step's deltas go to the server in one message,
    each :func:`encoded` (its prompt only in a prompt's first delta)."""

    def __init__(self, conn):
        self.conn = conn
        self.started: dict[str, set[int]] = {}  # request id -> its unfinished prompts whose first delta went

    def forget(self, request_id: str) -> None:
        """An aborted request: nothing more of it is sent."""
        self.started.pop(request_id, None)

    def call_soon_threadsafe(self, _put_all, puts: list) -> None:
        items = []
        for request_id, item in puts:
            if isinstance(item, BaseException):
                items.append((request_id, item))
                self.forget(request_id)
                continue
            index, out = item
            started = self.started.setdefault(request_id, set())
            first = index not in started
            if out.finished:
                started.discard(index)
                if not started:
                    del self.started[request_id]
            else:
                started.add(index)
            items.append((request_id, index, encoded(out, with_prompt=first)))
        with contextlib.suppress(OSError):  # the server is gone: the process stops when its pipe's end says so
            self.conn.send(("items", items))


class _RemoteStream:
    """The engine side of a request's stream: what :class:`AsyncEngine`'s loop reads and writes of one."""

    behind = False  # every delta is sent (the server's side has the reader)

    def __init__(self, request_id: str, num_prompts: int, sender: _Sender):
        self.request_id = request_id
        self.num_prompts = num_prompts
        self.states: list = []
        self.loop = sender
        self.queue = request_id  # (what the server maps back to its stream)
        self.pushed = 0

    def push(self, item) -> None:
        self.pushed += 1
        self.loop.call_soon_threadsafe(_put_all, [(self.request_id, item)])


class _EngineSide(AsyncEngine):
    """:class:`AsyncEngine`'s step loop in the engine's process, its requests from the pipe."""

    def __init__(self, engine: Engine, conn):
        super().__init__(engine)
        self.conn = conn
        self.sender = _Sender(conn)
        self._last_stats = 0.0
        self.num_added = 0

    def _add(self, stream, prompts, params) -> None:
        self.num_added += 1
        super()._add(stream, prompts, params)

    def _abort(self, request_id: str) -> None:
        super()._abort(request_id)
        self.sender.forget(request_id)

    def _run(self) -> None:
        super()._run()
        if self.error is not None:  # (its streams have the error already) the server stops taking requests
            with contextlib.suppress(OSError):
                self.conn.send(("failed", f"{type(self.error).__name__}: {self.error}"))

    def _publish(self) -> None:
        """The statistics, made only when they are sent (idle, or every :data:`STATS_INTERVAL_S`): their count of
        waiting requests looks at every stream."""
        now = time.monotonic()
        if not self.engine.has_unfinished() or now - self._last_stats >= STATS_INTERVAL_S:
            super()._publish()
            self.stats = dataclasses.replace(self.stats, requests_added=self.num_added)
            self._last_stats = now
            self.conn.send(("stats", self.stats))

    def publish_first(self) -> None:
        """The statistics before any step, which the server waits for: no step and no engine-thread CPU time yet
        (this thread's, which built the engine, would make the first line's engine share negative)."""
        super()._publish()
        self.stats = dataclasses.replace(self.stats, steps=0, engine_cpu_s=0.0, requests_added=0)
        self.conn.send(("stats", self.stats))

    def serve(self) -> None:
        """Take the server's messages (a list a send: all it queued meanwhile) until it says stop or goes away;
        the step loop is woken once a list."""
        while True:
            try:
                messages = self.conn.recv()
            except (EOFError, OSError):
                break
            stop = False
            for kind, *payload in messages:
                if kind == "add":
                    request_id, num_prompts, prompts, params = payload
                    with self._pending_lock:
                        self._pending += 1
                    self._inbox.put(("add", _RemoteStream(request_id, num_prompts, self.sender), prompts, params))
                elif kind == "abort":
                    self._inbox.put(("abort", payload[0]))
                elif kind == "stop":
                    stop = True
                    break
            self._wake.set()
            if stop:
                break


def _engine_main(config: EngineConfig, conn, log_level: int, registered: dict) -> None:
    """The engine's process: register the server's models and attention backends, build the engine, say it
    is ready (with what the server's facade needs), step requests from the pipe until told to stop; a failure
    is sent as one line."""
    from ..engine.build import build_engine
    from ..engine.parallel.worker import register_all

    # Ctrl-C in a terminal signals the whole foreground group: the server decides (it drains its streams
    # first, with this engine stepping, then sends stop); SIGTERM still ends this process at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    portattn_logger = logging.getLogger("portattn")  # the server's lines and the engine's, alike on stderr
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    portattn_logger.addHandler(handler)
    portattn_logger.setLevel(log_level)
    portattn_logger.propagate = False
    if config.device.type == "cpu":  # as portattn serve sets its own process's on a CPU
        from .lifecycle import cpu_threads

        threads, why = cpu_threads()
        torch.set_num_threads(threads)
        logger.info("CPU: the engine process's intra-op threads: %d (%s)", threads, why)
    try:
        register_all(**registered)
        engine = build_engine(config)
    except BaseException as exc:
        conn.send(("failed", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    side = _EngineSide(engine, conn)
    conn.send(
        (
            "ready",
            {
                "config": engine.config,
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.vocab_size,
                "model_class": type(engine.model).__name__,
            },
        )
    )
    side.publish_first()
    from .gc_pauses import SLOW_COLLECTION_S, freeze_start_up_objects, log_slow_collections

    freeze_start_up_objects()  # as portattn serve's process does: a full collection would stop the steps
    log_slow_collections(SLOW_COLLECTION_S)
    side.start()
    side.serve()
    side.shutdown()
