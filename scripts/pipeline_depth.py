"""How many K/V tiles the decode kernel keeps in flight, per launch shape, without a GPU.

``python scripts/pipeline_depth.py [--kv bf16|fp8_e4m3|fp8_e5m2] [--block-n 64 128] [--warps 4 8]
[--stages 3 4 5 6 8] [--q-len 1] [--block-m M] [--mla-heads H]`` compiles the paged attention kernel
of a decode (or ``--q-len`` queries; 32 query / 8 KV heads of 128, page 16, bfloat16 queries; or
with ``--mla-heads`` the MLA decode kernel over a 512 + 64 latent cache of page 64) for Hopper (sm_90,
through ptxas) at each tile shape and pipeline depth, and prints the shared-memory buffers Triton's
software pipeliner gives the K tile (from the TTGIR's ``local_alloc``), the asynchronous copies in
the PTX and which tensor-core instruction the dots use (``wgmma`` or ``mma.sync``). The launch is first captured from a
real call under ``TRITON_INTERPRET`` in a child process, so the signature, the specialised
alignments and the constexprs are the launcher's.

What it showed (Triton 3.9 here; ``benchmarks/results/round4_h200/NOTES.md``): the K/V loads depend
on a page-table load in the same iteration, and the pipeliner spends two stages per buffer on that
chain: ``floor((num_stages - 1) / 2)`` buffers, so 3 or 4 stages keep one tile (no overlap of loads
with compute), 5 or 6 keep two, 7 or 8 three. The MLA decode kernel, which loads its page ids a
block ahead by hand, keeps ``num_stages - 1`` latent tiles over a bf16 cache, and none over an fp8
one: its fp8 latent rows are plain loads at every depth. The last column counts the PTX's 8- and
16-bit shared-memory loads and its ``ldmatrix`` instructions: over an fp8 cache the V operand is read
a byte at a time (384 ``ld.shared.b8`` at 128 x 4 x 3), which round 5 found not to be what limits it
(``benchmarks/results/round5_h200/NOTES.md``). ``PIPELINE_DEPTH_DUMP=file`` writes the last TTGIR
there and the PTX beside it (``file.ptx``). The capture needs Triton 3.9's interpreter (3.6's fails
in the kernel's page-table arithmetic); the compile runs on any machine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KV_DTYPES = {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
TRITON_TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}  # fmt: skip


def _recorder(module, name: str, seen: dict):
    """Replace ``module.name`` (a Triton kernel) with a wrapper that records its launch."""
    import torch

    kernel = getattr(module, name)

    class Recorder:
        def __getitem__(self, grid):
            def call(*args, **kwargs):
                sig, ints = {}, {}
                for arg_name, arg in zip(kernel.arg_names, args):
                    if isinstance(arg, torch.Tensor):
                        sig[arg_name] = "*" + TRITON_TYPES[str(arg.dtype).removeprefix("torch.")]
                    elif isinstance(arg, bool):
                        sig[arg_name] = "i1"
                    elif isinstance(arg, int):
                        sig[arg_name], ints[arg_name] = "i32", arg
                    else:
                        sig[arg_name] = "fp32"
                opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
                seen.setdefault("sig", sig)
                seen.setdefault("ints", ints)
                seen.setdefault("constexprs", kwargs)
                seen.setdefault("opts", opts)
                return kernel[grid](*args, **kwargs)

            return call

    setattr(module, name, Recorder())


def capture(kv: str, q_len: int = 1, mla_heads: int = 0) -> dict:
    """Under the interpreter: one call of ``portattn.paged_attention`` (``q_len`` queries over 256
    keys), or with ``mla_heads`` of ``portattn.mla_decode`` (latent rank 512 + 64, page 64), with the
    kernel's launch recorded (argument types, integer values, constexprs)."""
    import torch

    import portattn
    from portattn.kernels.triton import launch, mla_decode_launch
    from portattn.kv_quant import quantize_kv

    seen: dict = {}
    dtype = getattr(torch, KV_DTYPES[kv])
    scale = 1.0 if kv == "bf16" else 0.5
    # the queries in float16 under the interpreter (its bfloat16 dots are not what is measured); the
    # compile takes bfloat16 queries, as an engine's decode has them
    if mla_heads:
        _recorder(mla_decode_launch, "mla_decode_split_kernel", seen)
        cache = torch.randn(8, 64, 576, dtype=torch.float16)
        cache = cache.to(torch.bfloat16) if kv == "bf16" else quantize_kv(cache.float(), dtype, scale)
        q_nope = torch.randn(1, mla_heads, 512, dtype=cache.dtype if kv == "bf16" else torch.float16)
        q_rope = torch.randn(1, mla_heads, 64, dtype=q_nope.dtype)
        table = torch.arange(8, dtype=torch.int32)[None]
        portattn.mla_decode(
            q_nope, q_rope, cache, table, torch.tensor([512], dtype=torch.int32), scale=0.1, backend="triton",
            kv_scale=scale, num_kv_splits=1,
        )  # fmt: skip
        seen["kernel"] = "mla"
        return seen
    _recorder(launch, "attention_fwd_kernel", seen)
    q = torch.randn(q_len, 32, 128, dtype=torch.float16)
    cache = [torch.randn(16, 16, 8, 128, dtype=torch.float16) for _ in range(2)]
    if kv == "bf16":
        cache = [c.to(torch.bfloat16) for c in cache]
        q = q.to(torch.bfloat16)
    else:
        cache = [quantize_kv(c.float(), dtype, scale) for c in cache]
    table = torch.arange(16, dtype=torch.int32)[None]
    cu, lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([256], dtype=torch.int32)
    portattn.paged_attention(q, *cache, table, cu, lens, backend="triton", k_scale=scale, v_scale=scale)
    seen["kernel"] = "paged"
    return seen


def compile_variants(seen: dict, block_ns, warps, stages) -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from portattn.kernels.triton.attention import attention_fwd_kernel
    from portattn.kernels.triton.launch import f16_dots_for
    from portattn.kernels.triton.mla_decode import mla_decode_split_kernel

    mla = seen["kernel"] == "mla"
    kernel = mla_decode_split_kernel if mla else attention_fwd_kernel
    queries, cache = ("QNope", "KV") if mla else ("Q", "K")
    sig = dict(seen["sig"], Out="*bf16", **({"QRope": "*bf16"} if mla else {}))
    sig[queries] = "*bf16"
    kv_dtype = {v: k for k, v in TRITON_TYPES.items()}[sig[cache].lstrip("*")]
    f16 = f16_dots_for(torch.bfloat16, getattr(torch, kv_dtype))
    constexprs = dict(seen["constexprs"], F16_DOTS=f16 and (not mla or seen["constexprs"]["BLOCK_H"] <= 32))
    for param in inspect.signature(kernel.fn).parameters.values():  # constexprs the launch left at their default
        if param.name not in constexprs and param.name not in seen["sig"] and param.default is not param.empty:
            constexprs[param.name] = param.default
    names = kernel.arg_names
    # What the JIT specialises: integers equal to 1 become constants; 16-byte aligned pointers and
    # integers that are multiples of 16 are marked so.
    ones = {n for n, v in seen["ints"].items() if v == 1}
    constexprs.update({n: 1 for n in ones})
    sig = {n: t for n, t in sig.items() if n not in ones}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n, t in sig.items()
        if t.startswith("*") or (seen["ints"].get(n, 1) % 16 == 0 and seen["ints"].get(n) != 0)
    }
    rows = f"block_h {constexprs['BLOCK_H']}" if mla else f"block_m {constexprs['BLOCK_M']}"
    print(f"{'MLA latent' if mla else 'K/V'} {kv_dtype}, queries bfloat16 (F16_DOTS={constexprs['F16_DOTS']}), {rows}")
    print("block_n warps stages | K buffers  async copies (TTGIR / PTX)  dots      shared loads (8/16-bit, ldmatrix)")
    for block_n in block_ns:
        for w in warps:
            for s in stages:
                const = dict(constexprs, BLOCK_N=block_n)
                source = ASTSource(
                    fn=kernel, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const, attrs=attrs
                )
                options = {"num_warps": w, "num_stages": s}
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
                ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
                if os.environ.get("PIPELINE_DEPTH_DUMP"):
                    Path(os.environ["PIPELINE_DEPTH_DUMP"]).write_text(ttgir)
                    Path(os.environ["PIPELINE_DEPTH_DUMP"] + ".ptx").write_text(ptx)
                width = constexprs["BLOCK_R"] if mla else 128
                tile = re.search(rf"local_alloc[^\n]*memdesc<(\d+)x{block_n}x{width}x", ttgir)
                buffers = int(tile.group(1)) if tile else 0
                copies = len(re.findall("async_copy_global_to_local", ttgir))
                in_ptx = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
                mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
                narrow = len(re.findall(r"ld\.shared(?:\.v\d)?\.[bu](?:8|16)\b", ptx))
                ldmatrix = ptx.count("ldmatrix")
                print(f"{block_n:7} {w:5} {s:6} | {buffers:9}  {copies} / {in_ptx:<5} {mma:9} {narrow:5} {ldmatrix:5}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", choices=sorted(KV_DTYPES), default="fp8_e4m3")
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5, 6, 8])
    parser.add_argument("--q-len", type=int, default=1, help="queries of the sequence (1: a decode)")
    parser.add_argument("--block-m", type=int, default=None, help="query rows (default: the launcher's)")
    parser.add_argument("--mla-heads", type=int, default=0, help="MLA decode of this many heads instead")
    parser.add_argument("--pages-ahead", action="store_true", help="page ids loaded a tile ahead (PAGES_AHEAD)")
    parser.add_argument("--merge-in-kernel", action="store_true", help="a split launch merging its splits itself")
    parser.add_argument("--capture", action="store_true", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.capture:
        print(json.dumps(capture(args.kv, args.q_len, args.mla_heads)))
        return 0
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    child = subprocess.run(
        [sys.executable, __file__, "--capture", "--kv", args.kv, "--q-len", str(args.q_len),
         "--mla-heads", str(args.mla_heads)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if child.returncode != 0:
        print(child.stderr[-3000:], file=sys.stderr)
        return child.returncode
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    os.environ.pop("TRITON_INTERPRET", None)
    if args.block_m is not None:
        group_pad = seen["constexprs"]["GROUP_PAD"]
        seen["constexprs"].update(BLOCK_M=args.block_m, BLOCK_Q=args.block_m // group_pad)
    if args.pages_ahead:
        seen["constexprs"]["PAGES_AHEAD"] = True
    if args.merge_in_kernel:
        seen["constexprs"].update(SPLIT=True, MERGE_IN_KERNEL=True)
    compile_variants(seen, args.block_n, args.warps, args.stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
