"""The seesaw kernel's in-kernel split merge (``mla_decode_launch.SEESAW_MERGE``) against the float64 reference and
against the merge kernel: page 64 e4m3 with 64 heads, page 16 e5m2 with 100 heads (bf16 queries; ``all``: fp16 too),
2, 3 and 7 splits (short sequences leave splits empty), each call twice (the counters set back to 0 between):
``python3 merge_check.py [all]`` (with ``tests`` importable)."""

import itertools
import sys

import torch

from kernels import test_mla_wide_fp8 as t
from portattn.kernels.triton import mla_decode_launch
from portattn.kernels.triton import mla_decode_wide_fp8 as wide_fp8
from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward
from portattn.testing import max_error

wide_fp8.SEESAW = True
failures = 0
for page_size, heads, cache in ((64, 64, torch.float8_e4m3fn), (16, 100, torch.float8_e5m2)):
    tiles = MLATileConfig(64, 64, 8, 2, wide=True, producer=True, fp8_scores=True, fp8_values=True)
    for c in itertools.islice(t.quantized_cases(page_size, 64, heads, cache), 2 if "all" in sys.argv else 1):
        inputs, ref, ref_lse, batch = c.inputs, c.ref, c.ref_lse, len(c.inputs["seq_lens"])
        weighted, plain = t.value_magnitudes(inputs, c.q8, c.exact, t.SCALE)
        allowed = c.tol + c.drift + 2.0**-4 * weighted + 2.0**-18 * plain
        args = [inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")]
        for splits in (2, 3, 7):
            outs = {}
            for merge, run in ((True, 0), (True, 1), (False, 0)):
                mla_decode_launch.SEESAW_MERGE = merge
                workspace = torch.empty(4 * batch * heads * splits * 513, dtype=torch.uint8, device="cuda")
                out = torch.full_like(inputs["q_nope"], float("nan"))
                lse = torch.full((batch, heads), float("nan"), device="cuda")
                mla_decode_forward(*args, out, scale=t.SCALE, num_kv_splits=splits, workspace=workspace, lse=lse,
                                   tiles=tiles, kv_scale=t.KV_SCALE)  # fmt: skip
                outs[merge, run] = out, lse
                finite = torch.isfinite(ref_lse)
                error = (out.double() - ref).abs()
                lse_error = max_error(lse[finite], ref_lse[finite]) / float(ref_lse[finite].abs().max())
                empty = bool(torch.equal(out[-1], torch.zeros_like(out[-1])))  # the sequence without keys
                ok = (bool(torch.equal(torch.isfinite(lse), finite)) and empty and bool((error <= allowed).all())
                      and lse_error <= t.LSE_REL_TOL)  # fmt: skip
                failures += not ok
                print(f"{c.dtype}, {cache}, page {page_size}, {heads} heads, {splits} splits, "
                      f"{'in-kernel merge' if merge else 'merge kernel'} (call {run}): max error "
                      f"{float(error.max()):.3e}, largest share of its bound {float((error / allowed).max()):.3f}, "
                      f"LSE {lse_error:.3e}{'' if ok else '  FAILED'}", flush=True)  # fmt: skip
            same = all(torch.equal(a, b) for a, b in zip(outs[True, 0], outs[True, 1], strict=True))
            apart = max_error(outs[True, 0][0], outs[False, 0][0])
            lse_apart = max_error(outs[True, 0][1][finite], outs[False, 0][1][finite])
            counters = mla_decode_launch._MERGE_COUNTERS
            zero = all(int(b.abs().max()) == 0 for held in counters.values() for b in held)
            failures += not (same and zero)
            print(f"  the two in-kernel calls equal: {same}; against the merge kernel: output {apart:.3e}, LSE "
                  f"{lse_apart:.3e}; counters all 0 after: {zero}", flush=True)  # fmt: skip
print(f"{failures} failures")
