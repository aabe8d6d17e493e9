"""What a burst of requests costs to cross the server's pipe to the engine's process, one message a request
against one list: the reader's process has a thread spinning in Python beside the reader (as the engine's step
loop holds the GIL while it launches a step), so each message waits for the GIL before it is taken.

    python3 benchmarks/results/round39/scripts/pipe_burst.py

Prints, for each way, how long the sender was blocked (the server's event loop, before ``Outbox``) and when the
reader had all 255 requests of 1,024 token ids; with Python's default GIL switch interval (5 ms) and the engine
thread's (``async_engine.SWITCH_INTERVAL_S``, 0.5 ms).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import sys
import threading
import time

REQUESTS, TOKENS = 255, 1024


def reader(conn, batched: bool, switch_interval: float) -> None:
    sys.setswitchinterval(switch_interval)
    stop = False

    def spin() -> None:  # a step loop in Python
        x = 0
        while not stop:
            for i in range(1000):
                x += i

    threading.Thread(target=spin, daemon=True).start()
    taken = 0
    while taken < REQUESTS:
        message = conn.recv()
        taken += len(message) if batched else 1
    conn.send(time.perf_counter())
    stop = True


def main() -> None:
    context = mp.get_context("spawn")
    rng = random.Random(0)
    messages = [("add", f"r{i}", 1, [rng.randrange(2, 32000) for _ in range(TOKENS)]) for i in range(REQUESTS)]
    for switch_interval, batched in ((0.005, False), (0.005, True), (0.0005, False), (0.0005, True)):
        ours, theirs = context.Pipe()
        process = context.Process(target=reader, args=(theirs, batched, switch_interval))
        process.start()
        time.sleep(2)  # its start-up
        start = time.perf_counter()
        if batched:
            ours.send(messages)
        else:
            for message in messages:
                ours.send(message)
        blocked = time.perf_counter() - start
        received = ours.recv() - start
        way = "one list" if batched else "one message a request"
        print(f"GIL switch interval {switch_interval * 1e3:g} ms, {way}: the sender blocked {blocked * 1e3:.1f} ms;"
              f" all taken {received * 1e3:.1f} ms after the first")  # fmt: skip
        process.join()


if __name__ == "__main__":
    main()
