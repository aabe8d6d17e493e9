"""A tiny chat model served on 127.0.0.1 (a free port) by uvicorn on a thread of the test process."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from portattn.testing.chat import save_tiny_chat_checkpoint

# Prefix caching off: the tests check that every page goes back to the pool when requests end.
ENGINE = dict(page_size=4, num_pages=1024, max_num_seqs=64, max_model_len=512, enable_prefix_caching=False)


@functools.cache
def tiny_checkpoint(root: str, chat_template: bool = True) -> str:
    return save_tiny_chat_checkpoint(f"{root}/chat{int(chat_template)}", chat_template=chat_template)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("served"))


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Two xdist workers share two cores; the engine thread's intra-op threads would only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def running_server(model: str | None, app=None, **kwargs):
    """``(base url, app)`` of a server on 127.0.0.1, stopped on exit: ``app`` if given, else one made for
    ``model``."""
    import uvicorn

    from portattn.server import create_app

    if app is None:
        app = create_app(model, **{**ENGINE, **kwargs})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def served(model_root):
    """The default server: ``(base url, app)``."""
    with running_server(tiny_checkpoint(model_root)) as url_app:
        yield url_app


def request(url: str, method: str = "GET", body=None, headers=None, timeout: float = 30):
    """``(status, parsed JSON or text, headers)`` of one HTTP request; ``body`` a dict or raw bytes."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, hdrs = resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as err:
        status, raw, hdrs = err.code, err.read(), err.headers
    text = raw.decode()
    try:
        return status, json.loads(text), hdrs
    except json.JSONDecodeError:
        return status, text, hdrs


def wait_until(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class StepGate:
    """Holds the engine thread before each step until the test allows it (``allow(k)``: k more
    steps, ``allow(None)``: every step from now on)."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        self.cond = threading.Condition()
        self.allowed: int | None = 0
        self.entered = threading.Event()

    def __enter__(self):
        def held_step():
            with self.cond:
                self.entered.set()
                self.cond.wait_for(lambda: self.allowed is None or self.allowed > 0, timeout=30)
                if self.allowed:
                    self.allowed -= 1
            return self.step()

        self.engine.step = held_step
        return self

    def allow(self, steps: int | None) -> None:
        with self.cond:
            self.allowed = None if steps is None else self.allowed + steps
            self.cond.notify_all()

    def __exit__(self, *exc):
        self.allow(None)
        self.engine.step = self.step


@pytest.fixture(scope="module")
def llm(model_root):
    """The offline engine on the served model's checkpoint, to compare the server's answers with."""
    from portattn.engine.llm import LLM

    return LLM(tiny_checkpoint(model_root), **ENGINE)


@pytest.fixture(scope="module")
def client(served):
    """The official ``openai`` client of the served model."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=60, max_retries=0)
