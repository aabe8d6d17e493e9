"""Median cycles between the stamps of ``trace.py``'s files: ``python3 analyse_trace.py FILE...``.

Consumers (left, right), a pair ``i``: 0 loop top, 1 its tile landed (ready), 2 scores done, 3 the other's maximum
read, 4 probabilities published, 5 output scaled, 6 p_a and tile a's values ready, 7 p_b and tile b's ready, 8
tile a's product done, 9 both done. Producer, a tile ``t``: 0 loop top, 1 landed, 2 its value buffer free, 3
transposed and published, 4 its slot's scores done (the refill follows). Pairs 2 to the last but one, tiles 4 to
the last but two."""

import sys

import torch

CONSUMER = ["ready", "scores", "other max", "probabilities", "scale", "wait a", "wait b", "product a", "product b"]
PRODUCER = ["ready", "value buffer", "transpose", "slot's scores", "refill"]


def medians(stamps, events, first, last):
    """Median cycles from each event to the next (the last to the next step's first) and a step's period."""
    rows = stamps[first:last].double()
    nxt = stamps[first + 1 : last + 1, 0].double()
    gaps = [rows[:, e + 1] - rows[:, e] for e in range(events - 1)] + [nxt - rows[:, events - 1]]
    return [float(g.median()) for g in gaps], float((nxt - rows[:, 0]).median())


for path in sys.argv[1:]:
    trace = torch.load(path)
    print(path)
    for program in range(trace.shape[0]):
        for part, name in enumerate(("left", "right", "producer")):
            stamps = trace[program, part]
            steps = int((stamps[:, 0] != 0).sum())
            labels = CONSUMER if part < 2 else PRODUCER
            first, last = (2, steps - 2) if part < 2 else (4, steps - 3)
            if last <= first:
                print(f"  program {program} {name}: {steps} steps, too few")
                continue
            gaps, period = medians(stamps, len(labels) + (part < 2), first, last)
            text = ", ".join(f"{label} {gap:.0f}" for label, gap in zip([*labels, "to next"], gaps))
            print(f"  program {program} {name} ({steps} steps): period {period:.0f}: {text}")
