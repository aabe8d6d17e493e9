"""Round 27, calls 6 and 7 (run from the repository root on the GPU): does an engine start-up give a Triton kernel
another kernel's launcher when the GIL's switch interval is 0.1 ms? Each run is a fresh process that builds an
engine on a 2-layer Llama-3-8B-shaped checkpoint and generates 4 tokens. Call 6 ran `compile_ahead` as it was
(kernels loaded in its thread pool, "parallel") against the same with a lock around each load ("locked", the
CHILD's patch); this file is call 7's version: the product with the loads in turn, first on an empty Triton cache
("product-cold"), then on the warm one ("product")."""

import os
import subprocess
import sys
import time

CHILD = r"""
import sys, threading
sys.setswitchinterval(1e-4)
mode = sys.argv[2]
from portattn.kernels.triton import compile_ahead
if mode == "locked":
    lock = threading.Lock()
    real = compile_ahead._load
    def _load(kernel, index):
        with lock:
            real(kernel, index)
    compile_ahead._load = _load
from portattn import LLM, SamplingParams
import time
t = time.perf_counter()
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_model_len=1024, kv_cache_memory="2GiB")
out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
print("ok", out[0].outputs[0].token_ids, "construct_s", round(time.perf_counter() - t, 2))
"""


def main():
    sys.path.insert(0, "src")
    sys.path.insert(0, ".")
    from pathlib import Path

    from benchmarks import engine as bench

    path = bench.checkpoint("llama3_8b_2l", bench.llama3_8b_config(2), Path("/tmp/ckrace"))
    results = []
    t0 = time.time()
    import tempfile

    cold = tempfile.mkdtemp(prefix="tcold")
    for i, mode in enumerate(["product-cold", "product", "product", "product", "product", "product", "product"]):
        if time.time() - t0 > 330:
            break
        start = time.time()
        env = {**os.environ, "PYTHONPATH": "src"}
        if mode == "product-cold":
            env["TRITON_CACHE_DIR"] = cold
        p = subprocess.run([sys.executable, "-c", CHILD, path, mode], capture_output=True, text=True, env=env)
        ok = p.returncode == 0
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] if not ok else p.stdout.strip().splitlines()[-1:]
        results.append((i, mode, ok, round(time.time() - start, 1), tail))
        print(i, mode, "ok" if ok else "FAILED", round(time.time() - start, 1), tail, flush=True)
    for mode in ("product-cold", "product"):
        runs = [r for r in results if r[1] == mode]
        print(mode, sum(not r[2] for r in runs), "failed of", len(runs))


main()
