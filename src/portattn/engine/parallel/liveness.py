"""Which rank stopped answering: each rank other than 0 publishes a pulse in the job's store.

A collective that times out says only that it waited too long, not for whom. So every other rank
publishes, from a thread of its own every :data:`PULSE_S` seconds, how many of rank 0's messages
it has received and, while it runs the last one, for how long. When a collective of rank 0 fails
and no rank reported an error, rank 0 reads the pulses twice, some seconds apart:

* a rank whose beat did not move is stopped or frozen (a stopped process, a hung host): its
  thread cannot publish either;
* a rank whose beat moves but that still runs a message is stuck inside it (a hang in a forward:
  the main thread waits, the pulse thread does not).

The thread writes a few bytes to the store twice a second; the step loop only sets two attributes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

PULSE_S = 0.5  # how often a rank publishes its pulse


def pulse_key(rank: int) -> str:
    return f"portattn/tp/pulse/{rank}"


class Pulse:
    """A rank's side: its step loop calls :meth:`received` and :meth:`done` around each message."""

    def __init__(self, store, rank: int):
        self.store = store
        self.key = pulse_key(rank)
        self.count = 0  # messages received from rank 0
        self.busy_since: float | None = None  # time.monotonic() when the message being run arrived
        self.beat = 0
        self._set()  # the first one now: the rank's pulse exists once this returns
        threading.Thread(target=self._publish, name="portattn-tp-pulse", daemon=True).start()

    def received(self) -> None:
        self.busy_since = time.monotonic()
        self.count += 1

    def done(self) -> None:
        self.busy_since = None

    def _set(self) -> None:
        since = self.busy_since
        busy = -1.0 if since is None else time.monotonic() - since
        with contextlib.suppress(Exception):  # the store goes with rank 0: the rank exits then anyway
            self.store.set(self.key, f"{self.beat} {self.count} {busy:.3f}")
        self.beat += 1

    def _publish(self) -> None:
        while True:
            time.sleep(PULSE_S)
            self._set()


@dataclass(frozen=True)
class PulseReading:
    beat: int
    count: int  # messages the rank had received
    busy_s: float  # how long it has run the last one; negative: waiting for the next


def read_pulses(store, ranks: range) -> dict[int, PulseReading]:
    """The pulses the ranks published (a rank that never published, or an unreachable store: absent)."""
    out = {}
    for rank in ranks:
        with contextlib.suppress(Exception):
            if store.check([pulse_key(rank)]):
                beat, count, busy = store.get(pulse_key(rank)).decode().split()
                out[rank] = PulseReading(int(beat), int(count), float(busy))
    return out


def silent_ranks(before: dict[int, PulseReading], after: dict[int, PulseReading], waited_s: float) -> list[str]:
    """One line per rank that stopped answering, from two readings ``waited_s`` seconds apart
    (longer than a few :data:`PULSE_S`)."""
    lines = []
    for rank, first in sorted(before.items()):
        last = after.get(rank, first)
        if last.beat == first.beat:
            lines.append(
                f"tensor-parallel rank {rank} stopped answering: no sign of life in {waited_s:.1f} s "
                "(a stopped or frozen process, or its host)"
            )
        elif last.busy_s >= 0 and last.count == first.count:
            lines.append(
                f"tensor-parallel rank {rank} stopped answering: it is alive but still runs the step it "
                f"received {last.busy_s:.1f} s ago (message {last.count} from rank 0)"
            )
    return lines
