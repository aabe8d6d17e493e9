"""The burst's scheduling replayed on the CPU (round 35's notes): 256 prompts of 1024 tokens + 8 through a tiny
model at budget 2048, with the decode graphs' buffers and the pieces of 32-2048 tokens run eagerly and asynchronous
scheduling on, as the GPU server runs them; prints each step that was not launched ahead of the previous one's
tokens. From the repository root, after ``python -m benchmarks.random_checkpoint /tmp/cktiny --shape tiny``:

    PYTHONPATH=src python benchmarks/results/round35/scripts/burst_replay_cpu.py /tmp/cktiny
"""

import random
import sys

from portattn.engine.graphs import batch_size_buckets
from portattn.engine.llm import LLM
from portattn.engine.run_ahead import RunAhead
from portattn.engine.sampling_params import SamplingParams

llm = LLM(sys.argv[1], enforce_eager=True, page_size=16, max_num_seqs=256, max_model_len=4096,
          allow_long_max_model_len=True, max_num_batched_tokens=2048)  # fmt: skip
engine = llm.engine
engine.runner.enable_graphs(batch_size_buckets(256), capture=False, feed=True)
engine.runner.graphs.capture_all()
engine.runner.enable_piecewise(capture=False, token_buckets=(32, 64, 128, 256, 512, 1024, 2048))
engine.runner.piecewise.capture_all()
engine.run_ahead = run_ahead = RunAhead(engine)
launch_ahead, log = run_ahead._launch_ahead, []


def logged(launched):
    following = launch_ahead(launched)
    log.append((len(engine.scheduler.running), following is not None))
    return following


run_ahead._launch_ahead = logged
rng = random.Random(0)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
for _ in range(256):
    engine.add_request([rng.randrange(10, 500) for _ in range(1024)], params)
steps = 0
while engine.has_unfinished():
    engine.step()
    steps += 1
print(f"{steps} steps, {engine.runner.piecewise.steps} through the pieces")
for i, (running, ahead) in enumerate(log):
    if not ahead:
        print(f"call {i}: the step after was not launched ahead ({running} running)")
