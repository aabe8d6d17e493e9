"""What a burst of requests costs to cross the server's pipe to the engine's process, one message a request
against one list: the reader's process has a thread spinning in Python beside the reader (as the engine's step
loop holds the GIL while it launches a step), so each message waits for the GIL before it is taken.

    python3 benchmarks/results/round39/scripts/pipe_burst.py

Prints, for each way, how long the sender was blocked (the server's event loop, before ``Outbox``) and when the
reader had all 255 requests of 1,024 token ids.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time

REQUESTS, TOKENS = 255, 1024


def reader(conn, batched: bool) -> None:
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
    for batched in (False, True):
        ours, theirs = context.Pipe()
        process = context.Process(target=reader, args=(theirs, batched))
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
        print(f"{way}: the sender blocked {blocked * 1e3:.1f} ms; all taken {received * 1e3:.1f} ms after the first")
        process.join()


if __name__ == "__main__":
    main()
