"""The 8B checkpoint's decode step at batch 1 (and 64) in bfloat16 and with quantization="fp8" over the three
paths of its one-row steps: row_linear's byte-wise fp8 tiles (the default), row_linear reading the fp8 weight
as words of four values (fused_launch.ROW_LINEAR_WORDS, inline PTX), and norm_linear's tensor-core tiles
(linear.FP8_ROW_LINEAR off); greedy tokens of each fp8 path against the default fp8 path's.
Usage (repository root, PYTHONPATH=src): fp8_decode_ab.py CHECKPOINT OUT.json"""

import json
import sys
import time

import torch

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.kernels.triton import fused_launch
from portattn.models.layers import linear

checkpoint, out = sys.argv[1], sys.argv[2]
VARIANTS = [  # name, quantization, ROW_LINEAR_WORDS, FP8_ROW_LINEAR
    ("bf16", None, False, True),
    ("fp8 row_linear bytes", "fp8", False, True),
    ("fp8 row_linear words", "fp8", True, True),
    ("fp8 norm_linear tiles", "fp8", False, False),
]


def timed(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, outs


results = {}
for name, quantization, words, row_linear in VARIANTS:
    fused_launch.ROW_LINEAR_WORDS, linear.FP8_ROW_LINEAR = words, row_linear
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", quantization=quantization, max_model_len=2048,
              max_num_seqs=64, kv_cache_memory="16GiB", max_num_batched_tokens=8192)  # fmt: skip
    row = {}
    for batch in (1, 64):
        prompts = [torch.randint(0, 1000, (512,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(batch)]  # fmt: skip
        timed(llm, prompts, 8)
        steps = []
        for _ in range(3):  # three measurements: median and spread
            t_short, _ = timed(llm, prompts, 2)
            t_long, _ = timed(llm, prompts, 130)
            steps.append((t_long - t_short) / 128 * 1000)
        row[f"decode_step_ms_b{batch}"] = sorted(steps)[1]
        row[f"decode_step_ms_b{batch}_all"] = steps
    _, outs = timed(llm, [list(range(5, 300))], 32)
    row["tokens"] = outs[0].outputs[0].token_ids if hasattr(outs[0], "outputs") else outs[0].token_ids
    results[name] = row
    print(name, {k: v for k, v in row.items() if k != "tokens"}, flush=True)
    del llm
    torch.cuda.empty_cache()
base = results["fp8 row_linear bytes"]["tokens"]
for name, row in results.items():
    row["tokens_equal_default_fp8"] = sum(a == b for a, b in zip(row["tokens"], base)) / len(base)
    print(name, "greedy tokens equal to the default fp8 path's:", row["tokens_equal_default_fp8"], flush=True)
with open(out, "w") as f:
    json.dump(results, f, indent=1)
