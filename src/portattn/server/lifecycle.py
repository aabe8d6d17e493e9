"""Start-up and shutdown of ``portattn serve``.

Start-up: the port is bound before the model loads (:func:`bind_socket`), so a taken port fails in
a second, not after a long load. On a CPU the intra-op thread count is chosen (:func:`cpu_threads`).

Shutdown (:func:`serve`): the first SIGINT or SIGTERM stops accepting connections and lets the
requests in flight finish for at most ``shutdown_timeout`` seconds; then each one still open ends
with an error event (``server_shutdown``) and ``data: [DONE]`` (a whole response: a 503), and the
process exits with status 0. A second signal ends them at once. The signals are handled here, not
by uvicorn, which would re-raise them after its own shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket

import uvicorn

from .protocol import APIError

logger = logging.getLogger("portattn")

_FLUSH_S = 1.0  # after the streams are ended: time for their last events to leave


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening), or ``OSError`` naming the flag at fault."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise OSError(f"expected --host to name an address of this machine, got {host!r} ({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise OSError(f"expected a free --port, got {port}: {host}:{port} is in use (another server?)") from None
        raise OSError(f"expected --host {host!r} --port {port} to be bindable, got: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock


def cpu_threads(environ=os.environ) -> tuple[int, str]:
    """The intra-op thread count for serving on a CPU, and why: ``OMP_NUM_THREADS`` when set, else
    one per core less one. The engine thread's intra-op pool otherwise spins on every core against
    the event loop, which streams the tokens (several times slower on a small machine)."""
    if environ.get("OMP_NUM_THREADS"):
        # OpenMP also takes a list, one count per nesting level: the first is the intra-op pool's.
        text = environ["OMP_NUM_THREADS"].split(",")[0].strip()
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"expected OMP_NUM_THREADS to be a positive int, got {environ['OMP_NUM_THREADS']!r}")
        return int(text), "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1), f"{cores} cores, one left for the event loop; OMP_NUM_THREADS overrides"


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handling: :class:`_Shutdown` owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn before 0.29
        pass


class _Shutdown:
    def __init__(self, uvicorn_server: _Uvicorn, app, timeout: float, loop: asyncio.AbstractEventLoop):
        self.uvicorn = uvicorn_server
        self.loop = loop
        self.server = app.state.server
        self.timeout = timeout
        self.signals = 0

    def on_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        if self.signals == 1:
            self.server.stopping = True  # requests on open connections get 503 server_shutdown
            self.uvicorn.should_exit = True  # stops accepting, waits for the open requests
            logger.warning(
                "%s: shutting down; %d requests in flight get %g s to finish (--shutdown-timeout; a second "
                "signal ends them now)",
                sig.name,
                sum(not s.finished for s in self.server.streams),
                self.timeout,
            )
            self.loop.call_later(self.timeout, self.end_streams, "timed out")
        else:
            logger.warning("%s again: ending the requests in flight now", sig.name)
            self.end_streams("interrupted")
            self.loop.call_later(_FLUSH_S, setattr, self.uvicorn, "force_exit", True)

    def end_streams(self, why: str) -> None:
        error = APIError(
            503, f"the server is shutting down: request {why}", type="server_error", code="server_shutdown"
        )
        ended = self.server.end_streams(error)
        if ended:
            logger.warning("ended %d requests that were still running", ended)


async def serve(
    app, sock: socket.socket, *, shutdown_timeout: float, log_level: str = "warning", handle_signals: bool = True
) -> None:
    """Serve ``app`` on the bound ``sock`` until a signal, then shut down as the module describes.
    ``app.state.shutdown.on_signal(sig)`` (on the loop) acts as a signal does; ``handle_signals=False``
    leaves the process's signals alone (a server on a thread other than the main one)."""
    # uvicorn's own limit is a backstop past ours: by then every stream has been ended.
    config = uvicorn.Config(
        app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=int(shutdown_timeout + _FLUSH_S + 5)
    )
    server = _Uvicorn(config)
    loop = asyncio.get_running_loop()
    app.state.shutdown = shutdown = _Shutdown(server, app, shutdown_timeout, loop)
    app.state.exit_server = lambda: setattr(server, "should_exit", True)  # when the engine dies
    signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, shutdown.on_signal, sig)
    try:
        await server.serve(sockets=[sock])
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        app.state.server.engine.shutdown()  # lifespan's shutdown is skipped on a forced exit
