"""The host's part of a decode step: ``python -m benchmarks.host_path [--batch 64] [--device cpu] [--out F]``.

A batch of ``--batch`` sequences decodes through the captured-step path (the static buffers, with
capture where the device has graphs) of a tiny chat checkpoint whose model is stubbed: its forward
returns zeros and its LM head fixed random logits, so that what is timed is the engine's own work per
step. Each engine step is split into

* ``schedule``: ``Scheduler.schedule`` (pages reserved, the batch chosen);
* ``prepare``: the step's inputs written (``DecodeGraphs._write``: the pinned buffer, its copy, the
  plans into the static buffers);
* ``model``: the stubbed forward (close to nothing: what remains is the call);
* ``sample``: from the hidden states to the sampled ids on the host (LM head, sampler, the copy);
* ``outputs``: the rest of ``Engine.step``: token appends, stop checks, incremental detokenizing,
  prefix-cache commits.

Greedy and seeded sampling (temperature 0.8, top-p 0.9) are timed apart; the medians over
``--steps`` steps are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

SECTIONS = ("schedule", "prepare", "model", "sample", "outputs")


def timed(clock: dict, name: str, fn):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[name] += time.perf_counter() - start

    return run


def stub_model(model, vocab_size: int, device) -> None:
    """Forward -> zeros ``[T, H]``; LM head -> fixed random logits (a few near the top per row)."""
    hidden_size = model.config.hidden_size if hasattr(model, "config") else model.model.embed_tokens.weight.shape[1]
    logits = torch.randn(1024, vocab_size, generator=torch.Generator().manual_seed(0)).to(device)  # [rows, V]

    def forward(input_ids, positions, ctx):
        return torch.zeros(input_ids.shape[0], hidden_size, device=input_ids.device)

    def compute_logits(hidden):
        return logits[: hidden.shape[0]]

    model.forward = forward
    model.compute_logits = compute_logits


def sync(device) -> None:
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


def measure(llm, batch: int, steps: int, params) -> dict:
    """Median microseconds per decode step of each section, and of the whole step."""
    engine = llm.engine
    prompts = [[5 + (7 * i + j) % 300 for j in range(16)] for i in range(batch)]
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    clock: dict = defaultdict(float)
    runner, graphs, scheduler = engine.runner, engine.runner.graphs, engine.scheduler
    originals = (scheduler.schedule, runner.step, graphs._write, engine.model.forward)
    scheduler.schedule = timed(clock, "schedule", scheduler.schedule)
    runner.step = timed(clock, "runner", runner.step)
    graphs._write = timed(clock, "prepare", graphs._write)
    engine.model.forward = timed(clock, "model", engine.model.forward)
    rows = defaultdict(list)
    try:
        for _ in range(steps):
            clock.clear()
            sync(engine.config.device)
            start = time.perf_counter()
            engine.step()
            sync(engine.config.device)
            total = time.perf_counter() - start
            assert len(engine.scheduler.running) == batch, "a sequence stopped early"
            rows["step"].append(total)
            for name in ("schedule", "prepare", "model"):
                rows[name].append(clock[name])
            rows["sample"].append(clock["runner"] - clock["prepare"] - clock["model"])
            rows["outputs"].append(total - clock["runner"] - clock["schedule"])
    finally:
        scheduler.schedule, runner.step, graphs._write, engine.model.forward = originals
        for seq in list(engine.scheduler.running):
            engine.abort(seq.request_id)
    assert graphs.replays >= steps
    return {name: statistics.median(values) * 1e6 for name, values in rows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host's own work, not intra-op parallelism
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args) -> int:
    from portattn.engine.graphs import batch_size_buckets
    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams
    from portattn.testing.chat import save_tiny_chat_checkpoint

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as root:
        path = save_tiny_chat_checkpoint(Path(root) / "chat", vocab_size=384)
        max_len = 16 + 2 * args.steps + 64
        llm = LLM(path, device=device, dtype="float32", max_num_seqs=args.batch, max_model_len=max_len,
                  num_pages=args.batch * (max_len // 16 + 1), enforce_eager=True)  # fmt: skip
    engine = llm.engine
    stub_model(engine.model, engine.vocab_size, device)
    capture = device.type != "cpu"
    engine.runner.enable_graphs(batch_size_buckets(args.batch), capture=capture).capture_all()
    result: dict = {"batch": args.batch, "device": str(device), "steps": args.steps, "capture": capture}
    result["torch"] = torch.__version__
    cases = {
        "greedy": SamplingParams(temperature=0, max_tokens=4 * args.steps, ignore_eos=True),
        "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=4 * args.steps, ignore_eos=True),
    }
    for name, params in cases.items():
        measure(llm, args.batch, 10, params)  # warm-up
        result[name] = measure(llm, args.batch, args.steps, params)
    print(f"host path of a batch-{args.batch} decode step on {device} (median us; stubbed model)")
    print(f"| case | {' | '.join(SECTIONS)} | step |")
    print("|---" * (len(SECTIONS) + 2) + "|")
    for name in cases:
        row = result[name]
        print(f"| {name} | {' | '.join(f'{row[s]:.0f}' for s in SECTIONS)} | {row['step']:.0f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
