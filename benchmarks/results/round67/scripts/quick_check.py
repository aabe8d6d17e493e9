"""The fp8-values GPU test's check for forms of the seesaw kernel up to 32 heads: page 64 e4m3 with 17 heads, page
16 e5m2 with 32 heads, 1 and 3 splits, each form against the float64 reference within the test's bound, and how far
each is from the first: ``python3 quick_check.py FORM [FORM ...] [short]`` (with ``tests`` importable; ``short``:
the first case only). A form is ``default`` or settings ``NAME=value[,NAME=value]`` of ``mla_decode_seesaw_fp8``
(``module.NAME`` for another module of ``portattn.kernels.triton``)."""

import ast
import importlib
import itertools
import sys

import torch

from kernels import test_mla_wide_fp8 as t
from portattn.kernels.triton import mla_decode_wide_fp8 as wide_fp8
from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward
from portattn.testing import max_error


def settings(form: str) -> list[tuple[object, str, object]]:
    if form == "default":
        return []
    found = []
    for item in form.split(","):
        target, _, text = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(f"portattn.kernels.triton.{module or 'mla_decode_seesaw_fp8'}")
        if not hasattr(mod, name):
            raise SystemExit(f"expected an attribute of {mod.__name__}, got {name}")
        found.append((mod, name, ast.literal_eval(text)))
    return found


short = "short" in sys.argv
FORMS = {f: settings(f) for f in sys.argv[1:] if f != "short"} or {"default": []}
wide_fp8.SEESAW = True
failures = 0
CASES = ((64, 17, torch.float8_e4m3fn), (16, 32, torch.float8_e5m2))
for page_size, heads, cache in CASES[: 1 if short else 2]:
    tiles = MLATileConfig(64, 64, 8, 2, wide=True, producer=True, fp8_scores=True, fp8_values=True)
    for c in itertools.islice(t.quantized_cases(page_size, 64, heads, cache), 1 if short else 2):
        inputs, ref, ref_lse, batch = c.inputs, c.ref, c.ref_lse, len(c.inputs["seq_lens"])
        weighted, plain = t.value_magnitudes(inputs, c.q8, c.exact, t.SCALE)
        allowed = c.tol + c.drift + 2.0**-4 * weighted + 2.0**-18 * plain
        args = [inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")]
        outs = {}
        for splits, name in itertools.product((1, 3), FORMS):
            before = [(mod, n, getattr(mod, n)) for mod, n, _ in FORMS[name]]
            for mod, n, value in FORMS[name]:
                setattr(mod, n, value)
            try:
                for rep in range(2):  # twice: an in-kernel merge's counters must be back at 0 after the first
                    workspace = torch.empty(4 * batch * heads * splits * 513, dtype=torch.uint8, device="cuda")
                    out = torch.full_like(inputs["q_nope"], float("nan"))
                    lse = torch.full((batch, heads), float("nan"), device="cuda")
                    mla_decode_forward(*args, out, scale=t.SCALE, num_kv_splits=splits, workspace=workspace, lse=lse,
                                       tiles=tiles, kv_scale=t.KV_SCALE)  # fmt: skip
                    if rep:
                        again = torch.equal(out, outs[splits, name][0]) and torch.equal(
                            lse.nan_to_num(), outs[splits, name][1].nan_to_num()
                        )
                    else:
                        outs[splits, name] = (out, lse)
            finally:
                for mod, n, value in before:
                    setattr(mod, n, value)
            finite = torch.isfinite(ref_lse)
            error = (out.double() - ref).abs()
            lse_error = max_error(lse[finite], ref_lse[finite]) / float(ref_lse[finite].abs().max())
            empty = bool(torch.equal(out[-1], torch.zeros_like(out[-1])))  # the sequence without keys
            ok = (bool(torch.equal(torch.isfinite(lse), finite)) and empty and bool((error <= allowed).all())
                  and lse_error <= t.LSE_REL_TOL and again)  # fmt: skip
            failures += not ok
            print(f"{c.dtype}, {cache}, page {page_size}, {heads} heads, {splits} splits, {name}: max error "
                  f"{float(error.max()):.3e}, largest share of its bound {float((error / allowed).max()):.3f}, "
                  f"LSE {lse_error:.3e}{'' if again else ', the second launch differs'}"
                  f"{'' if ok else '  FAILED'}", flush=True)  # fmt: skip
        first = next(iter(FORMS))
        for splits, name in itertools.product((1, 3), list(FORMS)[1:]):
            (a, la), (b, lb) = outs[splits, first], outs[splits, name]
            same = torch.equal(a, b) and torch.equal(la.nan_to_num(), lb.nan_to_num())
            print(f"  {splits} splits: {name} differs from {first} by at most {max_error(a, b):.3e}"
                  f"{' (equal bit for bit)' if same else ''}")  # fmt: skip
print(f"{failures} failures")
