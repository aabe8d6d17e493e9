"""What the Gluon MLA kernels' tests share: the GPU check of a kernel's tiles against the float64 reference and the
portable kernel, the launches and merges recorded through the launcher on any machine, and, for the sm_90 compile
in a child process, a launch's arguments compiled as Triton's runtime binds them, the key loop of a kernel's PTX,
the sm_90 compile of a kernel's signature, its stack bytes and ptxas's notes on serialized warpgroup MMAs, and the
child process that runs the compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward
from portattn.testing import max_error


def check_against_reference_and_portable(
    inputs: dict, tiles: MLATileConfig, *, scale: float, kv_scale: float, ref, ref_lse, tol: float, lse_rel_tol: float
) -> None:
    """``tiles`` and the portable kernel at 1 and 3 splits (NaN-filled outputs): each output within ``tol`` of
    ``ref`` and of each other, the LSE finite where ``ref_lse`` is and within ``lse_rel_tol`` of its largest
    magnitude, and zeros for the last sequence (which has no keys)."""
    batch, num_heads = inputs["q_nope"].shape[:2]
    device = inputs["q_nope"].device
    args = [inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")]
    for splits in (1, 3):
        workspace = torch.empty(4 * batch * num_heads * splits * 513, dtype=torch.uint8, device=device)
        got = {}
        for name, t in (("gluon", tiles), ("portable", None)):
            out = torch.full_like(inputs["q_nope"], float("nan"))
            lse = torch.full((batch, num_heads), float("nan"), device=device)
            mla_decode_forward(*args, out, scale=scale, num_kv_splits=splits, workspace=workspace, lse=lse, tiles=t,
                               kv_scale=kv_scale)  # fmt: skip
            got[name] = out, lse
        out, lse = got["gluon"]
        where = f"{inputs['q_nope'].dtype}, {inputs['kv_cache'].dtype} cache, {splits} splits, {tiles}"
        err = max_error(out, ref)
        assert err <= tol, f"{where}: max error {err:.3e} > tolerance {tol:.3e}"
        assert max_error(out, got["portable"][0]) <= tol, where
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), where
        assert max_error(lse[finite], ref_lse[finite]) <= lse_rel_tol * float(ref_lse[finite].abs().max()), where
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), where  # no keys: zeros


def record_launches(monkeypatch, module, compute_units: int) -> tuple[list, list]:
    """Through ``mla_decode_forward`` without a GPU: ``module``'s launch (a Gluon MLA kernel's) and the split merge
    replaced by recorders, the Gluon tiles taken on any machine, ``compute_units`` SMs. Returns ``(launched,
    merged)``: each launch's ``(grid, args, kwargs)`` and each merge's arguments."""
    from portattn.kernels.triton import mla_decode_launch

    launched, merged = [], []

    class Merge:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: merged.append(args)

    monkeypatch.setattr(module, "launch", lambda *a, **k: launched.append(module.launch_arguments(*a, **k)))
    monkeypatch.setattr(mla_decode_launch, "gluon_lacks", lambda *args: None)
    monkeypatch.setattr(mla_decode_launch, "compute_units", lambda device: compute_units)
    monkeypatch.setattr(mla_decode_launch, "mla_decode_merge_kernel", Merge())
    return launched, merged


def compile_as_launched(module, heads: int, fn):
    """``(grid, KV's type, q_scale's type, shared bytes)`` of ``module.launch_arguments`` over small CPU tensors
    (3 sequences of ``heads`` heads, an e4m3 cache of page 64, 2 splits, 64 keys a step, 2 stages), bound and
    packed by Triton's runtime as a launch does, then compiled for sm_90: what a launch would pass, checked
    without a GPU. Runs in the compile tests' child process (no ``TRITON_INTERPRET``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    batch, pages, page = 3, 6, 64
    qn = torch.zeros(batch, heads, 512, dtype=torch.bfloat16)
    qr = torch.zeros(batch, heads, 64, dtype=torch.bfloat16)
    kv = torch.zeros(pages, page, 576).to(torch.float8_e4m3fn)
    table = torch.zeros(batch, 4, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.int32)
    out = torch.empty_like(qn)
    part_out = torch.empty(batch, heads, 2, 512)
    part_lse = torch.empty(batch, heads, 2)
    grid, args, kwargs = module.launch_arguments(
        qn,
        qr,
        kv,
        table,
        lens,
        out,
        out[:, :, 0],
        part_out,
        part_lse,
        q_scale=0.07,
        qk_scale_log2=0.5,
        kv_scale=0.05,
        num_kv_splits=2,
        write_partial=True,
        write_lse=False,
        min_split=256,
        block_n=64,
        stages=2,
    )
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    launched = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return grid, signature["KV"], signature["q_scale"], launched.metadata.shared


def key_loop(ptx: str) -> str:
    """The longest loop of a kernel's PTX (from a label to the furthest branch back to it): its key loop."""
    lines = ptx.splitlines()
    labels, loop = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(\$L__\w+):", line)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"\bbra(\.uni)?\s+(\$L__\w+);", line)
        if m and m.group(2) in labels and labels[m.group(2)] < i and i - labels[m.group(2)] > len(loop):
            loop = lines[labels[m.group(2)] : i + 1]
    return "\n".join(loop)


SKIP = 3  # a compile child's exit status when this Triton cannot compile for CUDA here
SCALES = ("q_scale", "qk_scale_log2", "kv_scale")  # the MLA kernels' float32 arguments


def compile_for_hopper(fn, ptrs: dict, constexprs: dict, options: dict, descriptors: dict | None = None):
    """The Gluon kernel ``fn`` compiled for sm_90 from its signature: ``ptrs`` the pointers' types, the scales
    float32, every other runtime argument int32, ``descriptors`` the mangled types of its tensor descriptors; the
    pointers and the cache's strides 16-byte aligned, as the launches bind them. Exits the child process with
    :data:`SKIP` where this Triton has no ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {name: ptrs.get(name) or ("fp32" if name in SCALES else "i32") for name in fn.arg_names
           if name not in constexprs}  # fmt: skip
    sig |= (descriptors or {}) | {name: "constexpr" for name in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name in ("stride_kv_page", "stride_kv_slot")}  # fmt: skip
    try:
        return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)  # fmt: skip
    except (FileNotFoundError, RuntimeError) as exc:
        if "ptxas" in str(exc):
            print("no ptxas:", exc)
            sys.exit(SKIP)
        raise


def cache_descriptors(kv: str, rows_a_copy: int, constexprs: dict) -> dict:
    """The mangled types of the TMA descriptors of the latent and rope (``CDesc``, ``PeDesc``: boxes of
    ``rows_a_copy`` rows, the layouts ``C_8`` and ``PE_8``) over an fp8 cache of type ``kv`` (``*fp8e4nv`` or
    ``*fp8e5``) of 64 rows (a launch's own shape and strides)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    rows = torch.empty(64, 576, dtype=torch.uint8).view(torch.float8_e4m3fn if kv == "*fp8e4nv" else torch.float8_e5m2)
    return {name: mangle_type(TensorDescriptor(rows, [64, 576], [576, 1], [rows_a_copy, width], constexprs[layout]))
            for name, width, layout in (("CDesc", 512, "C_8"), ("PeDesc", 64, "PE_8"))}  # fmt: skip


def serialized_mma_notes(kernel) -> list[str] | None:
    """ptxas's notes (C7510-C7519) that it serialized the kernel's warpgroup MMAs (each waited for before the next
    is issued), from its PTX compiled again with ``-v`` for sm_90a by the ptxas Triton compiles it with; None where
    there is none. Fails where ptxas fails, so that a note is never missed for want of a run."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    if not ptxas or not os.path.exists(ptxas):
        return None
    path = os.path.join(os.environ["OUT_DIR"], "kernel.ptx")
    with open(path, "w") as f:
        f.write(kernel.asm["ptx"])
    done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"], capture_output=True, text=True)
    assert done.returncode == 0, f"{ptxas} failed: {done.stderr[-1000:]}"
    return [line for line in (done.stdout + done.stderr).splitlines() if re.search(r"C751\d.*serialized", line)]


def stack_bytes(kernel) -> int:
    """The compiled kernel's stack bytes a thread (its spills, from cuobjdump), -1 where Triton ships no cuobjdump
    (the cubin is written to ``OUT_DIR``)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return -1
    path = os.path.join(os.environ["OUT_DIR"], "kernel.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def run_compile_child(tmp_path, source: str, name: str, timeout: int) -> list[str]:
    """Run ``source`` as a file (``@gluon.jit`` reads its functions' source) in a child process without
    ``TRITON_INTERPRET``, with ``src`` and ``tests`` importable, a fresh Triton cache and ``OUT_DIR`` =
    ``tmp_path``; skip where it exits with :data:`SKIP`, fail on any other error; its stripped stdout lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(__file__)
    paths = [os.path.abspath(os.path.join(here, "..", "..", "src")), os.path.abspath(os.path.join(here, ".."))]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled afresh: static_print runs while tracing
    env["OUT_DIR"] = str(tmp_path)
    child = tmp_path / f"{name}.py"
    child.write_text(source)
    done = subprocess.run([sys.executable, str(child)], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode == SKIP:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.strip() for line in done.stdout.splitlines()]
