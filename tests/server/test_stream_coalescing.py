"""A slow reader's stream: while the reader has not taken the last delta, the engine thread leaves the
new tokens of unfinished prompts for the next delta, which carries all of them; a finished prompt's
last delta always goes out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from portattn.server.async_engine import AsyncEngine, RequestStream


class GrowingState:
    """A prompt's state whose delta holds the tokens made since the last delta it gave."""

    def __init__(self):
        self.tokens, self.sent, self.finished = [], 0, False

    def step(self, token: int, finish: bool = False) -> None:
        self.tokens.append(token)
        self.finished = finish

    def output(self, delta: bool = True):
        new, self.sent = self.tokens[self.sent :], len(self.tokens)
        return SimpleNamespace(tokens=new, finished=self.finished) if new else None


def emit(async_engine: AsyncEngine, states: list[GrowingState], token: int, finish: set[int] = frozenset()) -> None:
    for i, state in enumerate(states):
        if not state.finished:
            state.step(token, finish=i in finish)
    async_engine._emit()


def test_a_slow_reader_gets_one_delta_of_every_token_it_missed():
    async def run():
        async_engine = AsyncEngine.__new__(AsyncEngine)
        async_engine._streams = {}
        stream = RequestStream(async_engine, "r", num_prompts=2)
        states = [GrowingState(), GrowingState()]
        stream.states.extend(states)
        async_engine._streams["r"] = stream
        taken = []
        reader = stream.__aiter__()

        emit(async_engine, states, 1)  # the reader is level: both prompts' first tokens go out
        await asyncio.sleep(0)
        assert stream.queue.qsize() == 2 and stream.behind
        for token in (2, 3):  # behind: nothing more is pushed
            emit(async_engine, states, token)
        emit(async_engine, states, 4, finish={1})  # prompt 1 finishes: its last delta goes out anyway
        await asyncio.sleep(0)
        assert stream.queue.qsize() == 3
        for _ in range(3):
            taken.append(await reader.__anext__())
        assert not stream.behind
        emit(async_engine, states, 5, finish={0})
        taken.append(await reader.__anext__())
        return taken

    taken = [(i, out.tokens, out.finished) for i, out in asyncio.run(run())]
    assert taken == [(0, [1], False), (1, [1], False), (1, [2, 3, 4], True), (0, [2, 3, 4, 5], True)]


def test_one_step_reaches_the_event_loop_in_one_call():
    """A step's deltas for every stream go to the event loop in one ``call_soon_threadsafe`` (a call a
    stream woke the loop once a stream), and each stream's queue gets its own, in order."""

    async def run():
        async_engine = AsyncEngine.__new__(AsyncEngine)
        async_engine._streams = {}
        streams, states = [], []
        for r in range(5):
            stream = RequestStream(async_engine, f"r{r}", num_prompts=1)
            stream.states.append(GrowingState())
            async_engine._streams[stream.request_id] = stream
            streams.append(stream)
            states.append(stream.states[0])
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: calls.append(args) or real(*args)
        try:
            emit(async_engine, states, 7)
            assert len(calls) == 1
            await asyncio.sleep(0)
            got = [stream.queue.get_nowait() for stream in streams]
            assert [(i, out.tokens) for i, out in got] == [(0, [7])] * 5
            assert all(stream.behind and stream.queue.empty() for stream in streams)
            emit(async_engine, states, 8, finish={2})  # behind: only the finished one's last delta
            assert len(calls) == 2
            await asyncio.sleep(0)
            assert [stream.queue.qsize() for stream in streams] == [0, 0, 1, 0, 0]
        finally:
            del loop.call_soon_threadsafe

    asyncio.run(run())
