"""Can MLA decode over an fp8 (e4m3) latent cache run both products in fp8 on Hopper's wgmma?

The production kernel (``src/portattn/kernels/triton/mla_decode.py``) converts an fp8 latent tile to 16 bits
and runs both products in 16 bits; on an H200 it ran at 0.82x (16 heads) / 0.87x (128 heads) the bf16
cache (``benchmarks/results/round20_h200/NOTES.md``). The value product ``p @ c_kv`` contracts over keys,
but a latent row holds its 512 dims contiguous, and 8-bit tensor-core operands cannot be transposed by
``ldmatrix.trans`` (sm_90's fp8 wgmma wants both shared-memory operands K-major).

This probe has its own split-KV MLA decode kernel (not the production one), with queries quantized to
e4m3 in the kernel (a scale a head from max |q|: values up to 448) and probabilities quantized to e4m3
(``p * P_SCALE``, undone in the final division), in two formulations:

* ``T`` (transposed): ``scores^T [BLOCK_N, BLOCK_H] = c8 [BLOCK_N, 512] @ q8n^T + k8 [BLOCK_N, 64] @ q8r^T``
  (the latent tile is the A operand, contraction over its contiguous dims: K-major), the online softmax
  along the keys axis (axis 0), and ``out^T [512, BLOCK_H] += c8^T [512, BLOCK_N] @ p8^T [BLOCK_N, BLOCK_H]``
  (``tl.trans(c8)`` is the A operand, contraction over keys: Triton has to transpose the fp8 tile);
* ``N`` (plain, as production): ``scores = q8n @ c8^T + q8r @ k8^T``, ``out += p8 @ c8`` (fp8 B operand
  ``c8 [BLOCK_N, 512]`` not K-major).

The value product's accumulation (``ACC``): ``inplace`` (``tl.dot(a, b, acc * alpha)``: Triton's fp8
default on sm_90, ``max_num_imprecise_acc`` 2**30, i.e. the tensor core's own reduced-precision
accumulation over the whole sequence), ``two`` (each tile into a fresh float32 accumulator, added on CUDA
cores), ``promote`` (``max_num_imprecise_acc=BLOCK_N``: Triton's own promotion once a tile).

Page addressing (``PAGES``): ``keys`` as production (a page id a key, read one tile ahead) or ``tile``
(``BLOCK_N <= page size``: one scalar page id a tile, read one tile ahead).

Modes (from the repository root):

``PYTHONPATH=src python scripts/mla_fp8_probe.py --ptx`` (no GPU, no TRITON_INTERPRET): compiles every
variant for sm_90 (``triton.compile`` + ptxas) and prints PTX counts of the key loop (wgmma e4m3 / 16-bit,
mma.sync, 8-bit shared loads/stores, byte permutes, conversions, async copies, ldmatrix/stmatrix),
shared memory and registers (spills). ``--dump DIR`` writes PTX/TTGIR.

``TRITON_INTERPRET=1 PYTHONPATH=src python scripts/mla_fp8_probe.py --check``: correctness against a
float64 reference over the dequantized fp8 cache (float16 queries; the interpreter's bf16 dots are broken).

``PYTHONPATH=src python scripts/mla_fp8_probe.py --bench [--out FILE.json]`` (an H200; Triton >= 3.6):
B=64, L=4096, page 64, 16 and 128 heads, bf16 queries; every variant as CUDA-graph replays beside the
production launch over bf16 and e4m3 caches and a copy ceiling; ms, ratio to the bf16 cache, relative error
``max|out - ref| / max|ref|`` against the float64 reference over the dequantized cache (4 sequences).

What the H200 showed (benchmarks/results/round27_h200/NOTES.md): Triton emits e4m3 wgmma for both products
in ``T``, but transposes the fp8 tile through registers and byte-wise shared stores (``v0``) or byte
permutes and ``stmatrix`` (``v3``), unpipelined; every variant ran at 0.14-0.33x the bf16 cache at 16 heads
and 0.08-0.47x at 128 (production over e4m3: 0.81x / 0.87x), and the e4m3 queries and probabilities add
3.9e-2 / 6.7e-2 of relative error.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from fp8_v_layout_probe import graph_ms, main_loop, ptx_instructions, ptxas_registers

from portattn.kernels.triton.mla_decode import _split_range

LOG2E = 1.4426950408889634
ACC_MODES = {"inplace": 0, "two": 1, "promote": 2}


@triton.jit
def _to_e4m3(x, PREROUND: tl.constexpr):
    """``x`` (float32, |x| <= 448) to e4m3. ``PREROUND``: first round to 3 mantissa bits (to nearest even) in
    float32, so that the cast is exact in e4m3's normal range: Triton 3.9's interpreter rounds float32 -> e4m3
    wrongly when rounding up crosses a power of two (31.3 -> 16, 127.8 -> 64: the exponent is not carried)."""
    if PREROUND:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
        x = b.to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _quarter(base, keys, end, stride_kv_slot, PAGE_SIZE: tl.constexpr, R: tl.constexpr, CH: tl.constexpr):
    """``[R / CH, len(keys), CH]``: element (c, i, w) is dim ``c * CH + w`` of key ``keys[i]``."""
    offs_c = tl.arange(0, R // CH)
    offs_w = tl.arange(0, CH)
    rows = base + (keys % PAGE_SIZE) * stride_kv_slot
    ptrs = rows[None, :, None] + (offs_c * CH)[:, None, None] + offs_w[None, None, :]
    return tl.load(ptrs, mask=(keys < end)[None, :, None], other=0.0)


@triton.jit
def _key_rows(base, keys, end, stride_kv_slot, offs_r, PAGE_SIZE: tl.constexpr):
    """``[len(keys), len(offs_r)]``: the latent rows of ``keys`` (in one page from ``base``), zero past ``end``."""
    return tl.load(
        (base + (keys % PAGE_SIZE) * stride_kv_slot)[:, None] + offs_r[None, :], mask=(keys < end)[:, None], other=0.0
    )


@triton.jit
def mla_fp8_probe_kernel(
    QNope,
    QRope,
    KV,
    PageTable,
    SeqLensK,
    Out,
    PartOut,
    PartLse,
    qk_scale_log2,  # softmax scale * kv_scale * log2(e)
    kv_scale,
    num_heads,
    num_kv_splits,
    stride_qn_b,
    stride_qn_h,
    stride_qr_b,
    stride_qr_h,
    stride_kv_page,
    stride_kv_slot,
    stride_pt_b,
    stride_o_b,
    stride_o_h,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    ACC: tl.constexpr,  # 0 in place, 1 two-level, 2 max_num_imprecise_acc=BLOCK_N
    TILE_PAGES: tl.constexpr,
    P_SCALE: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    # T only: 0 tl.trans(c8); 1 joined quarters; 2 joined quarters + the scores' tile again;
    # 3 as 2, the quarters loaded as [R / VCHUNK, keys, VCHUNK]; 4 as 3, loaded once
    VLOAD: tl.constexpr = 0,
    VCHUNK: tl.constexpr = 64,
    PREROUND: tl.constexpr = False,  # see _to_e4m3 (for the interpreter)
):
    """Rows of KV, the page table and the queries/outputs have unit stride along their last dim."""
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    num_keys = tl.load(SeqLensK + seq)
    start, end, _ = _split_range(num_keys, split, num_kv_splits, BLOCK_N, MIN_SPLIT)  # as production cuts

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, KV_LORA_RANK)
    offs_rp = tl.arange(0, ROPE_DIM)
    head_ok = offs_h < num_heads
    qn = tl.load(
        QNope + seq * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_r[None, :], mask=head_ok[:, None], other=0.0
    ).to(tl.float32)  # [BLOCK_H, R]
    qr = tl.load(
        QRope + seq * stride_qr_b + offs_h[:, None] * stride_qr_h + offs_rp[None, :], mask=head_ok[:, None], other=0.0
    ).to(tl.float32)  # [BLOCK_H, Dr]
    # e4m3 queries: a scale a head, so that its largest |value| maps to 448 (e4m3's largest)
    amax = tl.maximum(tl.max(tl.abs(qn), 1), tl.max(tl.abs(qr), 1))
    q_quant = 448.0 / tl.where(amax > 0.0, amax, 1.0)  # [BLOCK_H]
    q8n = _to_e4m3(qn * q_quant[:, None], PREROUND)
    q8r = _to_e4m3(qr * q_quant[:, None], PREROUND)
    s_scale = qk_scale_log2 / q_quant  # [BLOCK_H]: undoes the query scale, applies the softmax scale

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if TRANSPOSED:
        acc = tl.zeros([KV_LORA_RANK, BLOCK_H], dtype=tl.float32)  # out^T
        q8nT = tl.trans(q8n)  # [R, BLOCK_H]
        q8rT = tl.trans(q8r)
    else:
        acc = tl.zeros([BLOCK_H, KV_LORA_RANK], dtype=tl.float32)
    page_row = PageTable + seq * stride_pt_b
    offs_first = start + tl.arange(0, BLOCK_N)
    if TILE_PAGES:  # one page id a tile (BLOCK_N divides the page size), read a tile ahead
        next_page = tl.load(page_row + start // PAGE_SIZE, mask=start < end, other=0)
    else:  # a page id a key, read a tile ahead (as production)
        next_page = tl.load(page_row + offs_first // PAGE_SIZE, mask=offs_first < end, other=0)
    for block_start in tl.range(start, end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        page = next_page.to(tl.int64)
        if TILE_PAGES:
            next_start = block_start + BLOCK_N
            next_page = tl.load(page_row + next_start // PAGE_SIZE, mask=next_start < end, other=0)
        else:
            offs_next = offs_n + BLOCK_N
            next_page = tl.load(page_row + offs_next // PAGE_SIZE, mask=offs_next < end, other=0)
        rows = KV + page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot  # [BLOCK_N]
        if VLOAD == 0:
            c8 = tl.load(rows[:, None] + offs_r[None, :], mask=n_ok[:, None], other=0.0)  # [BLOCK_N, R] fp8
        elif VLOAD >= 3:
            # as 1/2, each quarter loaded as [R / VCHUNK, keys, VCHUNK] so that the lanes of a warp spread over
            # keys too (the default layout puts all 32 lanes along the 512 dims: transposed stores then hit one bank)
            offs_g = block_start + 4 * tl.arange(0, BLOCK_N // 4)
            base = KV + page * stride_kv_page
            c0 = _quarter(base, offs_g + 0, end, stride_kv_slot, PAGE_SIZE, KV_LORA_RANK, VCHUNK)
            c1 = _quarter(base, offs_g + 1, end, stride_kv_slot, PAGE_SIZE, KV_LORA_RANK, VCHUNK)
            c2 = _quarter(base, offs_g + 2, end, stride_kv_slot, PAGE_SIZE, KV_LORA_RANK, VCHUNK)
            c3 = _quarter(base, offs_g + 3, end, stride_kv_slot, PAGE_SIZE, KV_LORA_RANK, VCHUNK)
            cj = tl.join(tl.join(c0, c2), tl.join(c1, c3))
            cj = tl.reshape(cj, [KV_LORA_RANK // VCHUNK, BLOCK_N // 4, VCHUNK, 4])
            cT_j = tl.reshape(tl.permute(cj, [0, 2, 1, 3]), [KV_LORA_RANK, BLOCK_N])  # [R, keys]
            # 3: the scores' tile loaded again (pipelined, from the L2); 4: the scores' operand from the same registers
            c8 = tl.load(rows[:, None] + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            if VLOAD == 4:
                c8 = tl.trans(cT_j)
        else:
            # the tile as four interleaved quarters (keys 4g + j), joined so that each thread holds 4 consecutive
            # keys of each dim it holds: the keys-contiguous copy can then be stored 4 bytes at a time (the outer
            # join adds the last axis: [.., i, j] holds quarter 2i + j)
            offs_g = block_start + 4 * tl.arange(0, BLOCK_N // 4)
            base = KV + page * stride_kv_page
            c0 = _key_rows(base, offs_g + 0, end, stride_kv_slot, offs_r, PAGE_SIZE)
            c1 = _key_rows(base, offs_g + 1, end, stride_kv_slot, offs_r, PAGE_SIZE)
            c2 = _key_rows(base, offs_g + 2, end, stride_kv_slot, offs_r, PAGE_SIZE)
            c3 = _key_rows(base, offs_g + 3, end, stride_kv_slot, offs_r, PAGE_SIZE)
            cj = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [BLOCK_N // 4, KV_LORA_RANK, 4])
            cT_j = tl.reshape(tl.permute(cj, [1, 0, 2]), [KV_LORA_RANK, BLOCK_N])  # [R, keys]
            if VLOAD == 1:
                c8 = tl.trans(cT_j)
            else:  # the scores' tile loaded again, as it is (pipelined; from the L2)
                c8 = tl.load(rows[:, None] + offs_r[None, :], mask=n_ok[:, None], other=0.0)
        k8 = tl.load(rows[:, None] + (KV_LORA_RANK + offs_rp)[None, :], mask=n_ok[:, None], other=0.0)
        if TRANSPOSED:
            sT = tl.dot(c8, q8nT)  # [BLOCK_N, BLOCK_H]
            sT = tl.dot(k8, q8rT, sT)
            sT = tl.where(n_ok[:, None], sT * s_scale[None, :], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sT, 0))  # finite: every tile holds a key
            alpha = tl.exp2(m_i - m_new)
            pT = tl.exp2(sT - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pT, 0)
            p8 = _to_e4m3(pT * P_SCALE, PREROUND)  # [BLOCK_N, BLOCK_H]
            if VLOAD == 0:
                cT = tl.trans(c8)  # [R, BLOCK_N]: the A operand, contraction over keys
            else:
                cT = cT_j
            if ACC == 1:
                acc = acc * alpha[None, :] + tl.dot(cT, p8)
            elif ACC == 2:
                acc = tl.dot(cT, p8, acc * alpha[None, :], max_num_imprecise_acc=BLOCK_N)
            else:
                acc = tl.dot(cT, p8, acc * alpha[None, :])
        else:
            s = tl.dot(q8n, tl.trans(c8))  # [BLOCK_H, BLOCK_N]
            s = tl.dot(q8r, tl.trans(k8), s)
            s = tl.where(n_ok[None, :], s * s_scale[:, None], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p8 = _to_e4m3(p * P_SCALE, PREROUND)  # [BLOCK_H, BLOCK_N]
            if ACC == 1:
                acc = acc * alpha[:, None] + tl.dot(p8, c8)
            elif ACC == 2:
                acc = tl.dot(p8, c8, acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
            else:
                acc = tl.dot(p8, c8, acc * alpha[:, None])
        m_i = m_new

    has_keys = l_i > 0.0
    norm = kv_scale / (P_SCALE * tl.where(has_keys, l_i, 1.0))  # [BLOCK_H]; no keys: zeros
    if TRANSPOSED:
        out = tl.trans(acc * norm[None, :])  # [BLOCK_H, R]
    else:
        out = acc * norm[:, None]
    if WRITE_PARTIAL:
        if start < end:
            row = (seq * num_heads + offs_h) * num_kv_splits + split  # rows of [B, H, S]
            tl.store(PartOut + row[:, None] * KV_LORA_RANK + offs_r[None, :], out, mask=head_ok[:, None])
            tl.store(PartLse + row, m_i + tl.log2(l_i), mask=head_ok)
    else:
        tl.store(
            Out + seq * stride_o_b + offs_h[:, None] * stride_o_h + offs_r[None, :],
            out.to(Out.dtype.element_ty),
            mask=head_ok[:, None],
        )


# ----------------------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Variant:
    transposed: bool = True
    block_h: int = 16
    block_n: int = 64
    warps: int = 4
    stages: int = 2
    acc: str = "two"
    tile_pages: bool = True
    p_scale: float = 256.0
    maxnreg: int | None = None
    vchunk: int = 64  # vload 3: dims a chunk
    vload: int = 0  # T only: 0 tl.trans(c8), 1 joined quarters, 2 joined quarters + the scores' tile loaded again,
    # 3 as 2 with the quarters loaded as [512 / vchunk, keys, vchunk], 4 as 3 with the scores' operand from them

    @property
    def name(self) -> str:
        s = (f"{'T' if self.transposed else 'N'} h{self.block_h} n{self.block_n} w{self.warps} s{self.stages} "
             f"{self.acc} {'tile' if self.tile_pages else 'keys'}")  # fmt: skip
        s += f" v{self.vload}" if self.transposed else ""
        s += f"c{self.vchunk}" if self.transposed and self.vload >= 3 else ""
        return s + (f" r{self.maxnreg}" if self.maxnreg else "")


def probe_forward(qn, qr, kv, page_table, seq_lens, out, *, scale, kv_scale, num_kv_splits, v: Variant,
                  partials=None, min_split=64):  # fmt: skip
    """The probe kernel (+ the production merge when split) over ``kv [pages, P, 576]`` e4m3."""
    from portattn.kernels.triton.mla_decode import mla_decode_merge_kernel

    B, H, R = qn.shape
    Dr = qr.shape[2]
    P = kv.shape[1]
    assert kv.stride(2) == 1 and qn.stride(2) == 1 and qr.stride(2) == 1 and page_table.stride(1) == 1
    assert not v.tile_pages or P % v.block_n == 0, "tile pages: BLOCK_N must divide the page size"
    split = num_kv_splits > 1
    if split:
        if partials is None:
            partials = (torch.empty(B, H, num_kv_splits, R, device=qn.device, dtype=torch.float32),
                        torch.empty(B, H, num_kv_splits, device=qn.device, dtype=torch.float32))  # fmt: skip
        part_out, part_lse = partials
    else:
        part_out = part_lse = out
    extra = {"maxnreg": v.maxnreg} if v.maxnreg else {}
    grid = (triton.cdiv(H, v.block_h), num_kv_splits, B)
    mla_fp8_probe_kernel[grid](
        qn, qr, kv, page_table, seq_lens, out, part_out, part_lse,
        scale * kv_scale * LOG2E, kv_scale, H, num_kv_splits,
        qn.stride(0), qn.stride(1), qr.stride(0), qr.stride(1), kv.stride(0), kv.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1),
        KV_LORA_RANK=R, ROPE_DIM=Dr, PAGE_SIZE=P, BLOCK_H=v.block_h, BLOCK_N=v.block_n,
        TRANSPOSED=v.transposed, ACC=ACC_MODES[v.acc], TILE_PAGES=v.tile_pages, P_SCALE=v.p_scale,
        WRITE_PARTIAL=split, MIN_SPLIT=min_split, VLOAD=v.vload, VCHUNK=v.vchunk,
        PREROUND=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=v.warps, num_stages=v.stages, **extra,
    )  # fmt: skip
    if split:
        mla_decode_merge_kernel[(H, B)](
            part_out, part_lse, seq_lens, out, out,
            H, num_kv_splits, *out.stride(), 0, 0,
            KV_LORA_RANK=R, BLOCK_R=triton.next_power_of_2(R), SPLIT_ALIGN=v.block_n, WRITE_LSE=False,
            MIN_SPLIT=min_split, num_warps=4,
        )  # fmt: skip
    return out


def reference(qn, qr, kv, page_table, seq_lens, *, scale, kv_scale):
    """float64 MLA decode over the dequantized cache ``kv * kv_scale``."""
    from portattn.testing import mla_decode_ref

    deq = kv.to(torch.float64) * kv_scale
    return mla_decode_ref(qn, qr, deq, page_table, seq_lens, scale=scale)


def make_case(lens, heads, page_size, q_dtype, device, *, seed=0, cache_dtype=torch.bfloat16, kv_scale=0.05):
    """Queries ~N(0,1), a latent cache ~N(0,1) (``cache``) and its e4m3 quantization with scale ``kv_scale``
    (``c8``), a shuffled page table (as ``kernels_probe.py mla-fp8``)."""
    from portattn.kv_quant import quantize_kv

    gen = torch.Generator(device=device).manual_seed(seed)
    n_pages = [-(-n // page_size) for n in lens]
    width = max(1, max(n_pages))
    num_pages = sum(n_pages) + 3
    perm = torch.randperm(num_pages, generator=gen, device=device)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    i = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[i : i + n].to(torch.int32)
        i += n
    cache = torch.randn(num_pages, page_size, 576, generator=gen, device=device).to(cache_dtype)
    qn = torch.randn(len(lens), heads, 512, generator=gen, device=device).to(q_dtype)
    qr = torch.randn(len(lens), heads, 64, generator=gen, device=device).to(q_dtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    return {"qn": qn, "qr": qr, "cache": cache, "c8": quantize_kv(cache, torch.float8_e4m3fn, kv_scale),
            "page_table": table, "seq_lens": seq, "kv_scale": kv_scale}  # fmt: skip


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------------------------------------- --check


def check(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("on the CPU run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward

    q_dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    scale = 0.07
    cases = [(64, [1, 63, 200], 1), (64, [64, 65, 130], 2), (16, [65, 1, 200], 1), (16, [200, 63, 64], 3)]
    variants = [
        Variant(True, 16, 64, warps=8, acc="two", tile_pages=True, vload=3, vchunk=16),
        Variant(True, 16, 64, warps=8, acc="inplace", tile_pages=True, vload=4, vchunk=16),
        Variant(True, 16, 64, acc="two", tile_pages=True, vload=2),
        Variant(True, 16, 64, acc="two", tile_pages=True),
        Variant(True, 16, 64, acc="inplace", tile_pages=True),
        Variant(True, 16, 64, acc="promote", tile_pages=True),
        Variant(True, 16, 64, acc="two", tile_pages=False),
        Variant(True, 32, 64, acc="two", tile_pages=False),
        Variant(False, 16, 64, acc="two", tile_pages=True),
        Variant(False, 16, 32, acc="inplace", tile_pages=False),
    ]
    if args.quick:
        variants = variants[:1] + variants[3:4] + variants[8:9]
    worst = {}
    failed = 0
    for P, lens, splits in cases:
        heads = 16 if args.heads is None else args.heads
        s = make_case(lens, heads, P, q_dtype, device, seed=P + splits)
        ref = reference(s["qn"], s["qr"], s["c8"], s["page_table"], s["seq_lens"], scale=scale, kv_scale=s["kv_scale"])
        ref_q = reference(s["qn"], s["qr"], s["cache"], s["page_table"], s["seq_lens"], scale=scale, kv_scale=1.0)
        # the production kernel over the same fp8 cache (16-bit dots), for comparison
        out = torch.full_like(s["qn"], float("nan"))
        mla_decode_forward(s["qn"], s["qr"], s["c8"], s["page_table"], s["seq_lens"], out, scale=scale,
                           num_kv_splits=splits, kv_scale=s["kv_scale"],
                           workspace=torch.empty(4 * len(lens) * heads * splits * 513, dtype=torch.uint8,
                                                 device=device),
                           tiles=MLATileConfig(16, 16, 4, 1) if device.type == "cpu" else None)  # fmt: skip
        e, eq = rel_err(out, ref), rel_err(out, ref_q)
        print(f"P {P:2} lens {lens!s:15} splits {splits} {'production (16-bit dots)':34} rel err {e:.2e} "
              f"(vs unquantized cache {eq:.2e})", flush=True)  # fmt: skip
        worst["production"] = max(worst.get("production", 0.0), e)
        for v in variants:
            if v.tile_pages and P % v.block_n:
                continue
            out = torch.full_like(s["qn"], float("nan"))
            t0 = time.time()
            try:
                probe_forward(s["qn"], s["qr"], s["c8"], s["page_table"], s["seq_lens"], out, scale=scale,
                              kv_scale=s["kv_scale"], num_kv_splits=splits, v=v)  # fmt: skip
            except Exception as exc:
                print(f"P {P:2} lens {lens!s:15} splits {splits} {v.name:34} FAILED: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:200] if str(exc) else ''}", flush=True)  # fmt: skip
                failed += 1
                continue
            e, eq = rel_err(out, ref), rel_err(out, ref_q)
            ok = e < args.tol
            failed += not ok
            worst[v.name] = max(worst.get(v.name, 0.0), e)
            print(f"P {P:2} lens {lens!s:15} splits {splits} {v.name:34} rel err {e:.2e} (vs unquantized cache "
                  f"{eq:.2e}) {'ok' if ok else 'FAIL'} {time.time() - t0:.1f}s", flush=True)  # fmt: skip
    print("worst relative error against the dequantized cache's float64 reference:")
    for name, e in worst.items():
        print(f"  {name:34} {e:.2e}")
    print(f"{failed} failed (tolerance {args.tol})")
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------- --ptx

PTX_COUNTS = {  # name: regex over PTX instruction lines
    "wgmma.e4m3": r"^\s*(@%p\d+\s+)?wgmma\.mma_async\S*\.e4m3",
    "wgmma.16": r"^\s*(@%p\d+\s+)?wgmma\.mma_async\S*\.(bf16|f16)",
    "mma.sync": r"^\s*(@%p\d+\s+)?mma\.sync",
    "mma.e4m3": r"^\s*(@%p\d+\s+)?mma\.sync\S*\.e4m3",
    "ld.shared.8": r"^\s*(@%p\d+\s+)?ld\.shared(::cta)?(\.v\d)?\.[bsu]8\b",
    "st.shared.8": r"^\s*(@%p\d+\s+)?st\.shared(::cta)?(\.v\d)?\.[bsu]8\b",
    "ld.shared": r"^\s*(@%p\d+\s+)?ld\.shared",
    "st.shared": r"^\s*(@%p\d+\s+)?st\.shared",
    "ldmatrix": r"^\s*(@%p\d+\s+)?ldmatrix\.",
    "ldmatrix.trans": r"^\s*(@%p\d+\s+)?ldmatrix\.\S*\.trans",
    "stmatrix": r"^\s*(@%p\d+\s+)?stmatrix\.",
    "prmt": r"^\s*(@%p\d+\s+)?prmt\.",
    "shfl": r"^\s*(@%p\d+\s+)?shfl\.",
    "cvt.from8": r"^\s*(@%p\d+\s+)?cvt\.\S*\.e4m3x2\s",  # e4m3 -> f16x2
    "cvt.to8": r"^\s*(@%p\d+\s+)?cvt\.\S*e4m3x2\.f",  # f32/f16 -> e4m3x2
    "cp.async": r"^\s*(@%p\d+\s+)?cp\.async\.c[ag]\.",
    "tma": r"^\s*(@%p\d+\s+)?cp\.async\.bulk",
    "bar": r"^\s*(@%p\d+\s+)?(bar\.sync|barrier\.sync|bar\.warp)",
    "ld.global": r"^\s*(@%p\d+\s+)?ld\.global",
}
SHORT = {"wgmma.e4m3": "wg8", "wgmma.16": "wg16", "mma.sync": "mma", "mma.e4m3": "mma8", "ld.shared.8": "lds8",
         "st.shared.8": "sts8", "ld.shared": "lds", "st.shared": "sts", "ldmatrix": "ldmx", "ldmatrix.trans": "ldmxT",
         "stmatrix": "stmx", "prmt": "prmt", "shfl": "shfl", "cvt.from8": "cvt<8", "cvt.to8": "cvt>8",
         "cp.async": "cpas", "tma": "tma", "bar": "bar", "ld.global": "ldg"}  # fmt: skip


def count(instructions):
    return {name: sum(1 for t in instructions if re.match(rx, t)) for name, rx in PTX_COUNTS.items()}


def ptx_variants(args):
    out = []
    for transposed in [t == "T" for t in args.transposed]:
        for block_h in args.block_h:
            for block_n in args.block_n:
                for warps in args.warps:
                    for stages in args.stages:
                        for acc in args.acc:
                            for tile in args.pages:
                                if tile == "tile" and 64 % block_n:
                                    continue
                                for vload in args.vload if transposed else [0]:
                                    if vload and tile != "tile":  # the quarters' loads take one page id a tile
                                        continue
                                    for ch in args.vchunk if vload >= 3 else [64]:
                                        out.append(
                                            Variant(
                                                transposed,
                                                block_h,
                                                block_n,
                                                warps,
                                                stages,
                                                acc,
                                                tile == "tile",
                                                maxnreg=args.maxnreg,
                                                vload=vload,
                                                vchunk=ch,
                                            )
                                        )
    return out


def compile_variant(v: Variant, heads: int, q_type="*bf16"):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    P, R, Dr, L = 64, 512, 64, 4096
    ints = {"num_heads": heads, "num_kv_splits": 4, "stride_qn_b": heads * R, "stride_qn_h": R,
            "stride_qr_b": heads * Dr, "stride_qr_h": Dr, "stride_kv_page": P * (R + Dr),
            "stride_kv_slot": R + Dr, "stride_pt_b": L // P, "stride_o_b": heads * R, "stride_o_h": R}  # fmt: skip
    sig = {"QNope": q_type, "QRope": q_type, "KV": "*fp8e4nv", "PageTable": "*i32", "SeqLensK": "*i32",
           "Out": q_type, "PartOut": "*fp32", "PartLse": "*fp32", "qk_scale_log2": "fp32", "kv_scale": "fp32",
           **{n: "i32" for n in ints}}  # fmt: skip
    names = mla_fp8_probe_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n, t in sig.items() if t.startswith("*") or (n in ints and ints[n] % 16 == 0)}  # fmt: skip
    const = dict(KV_LORA_RANK=R, ROPE_DIM=Dr, PAGE_SIZE=P, BLOCK_H=v.block_h, BLOCK_N=v.block_n,
                 TRANSPOSED=v.transposed, ACC=ACC_MODES[v.acc], TILE_PAGES=v.tile_pages, P_SCALE=v.p_scale,
                 WRITE_PARTIAL=heads <= 16, MIN_SPLIT=64, VLOAD=v.vload, VCHUNK=v.vchunk, PREROUND=False)  # fmt: skip
    source = ASTSource(fn=mla_fp8_probe_kernel, signature={**sig, **{c: "constexpr" for c in const}},
                       constexprs=const, attrs=attrs)  # fmt: skip
    options = {"num_warps": v.warps, "num_stages": v.stages}
    if v.maxnreg:
        options["maxnreg"] = v.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def ttgir_summary(ttgir: str, stages: int) -> str:
    """Which dots became wgmma (warp_group_dot) or mma v2, and how many async copies/local stores there are."""
    wg = len(re.findall(r"ttng\.warp_group_dot ", ttgir))
    mma2 = len(re.findall(r"= tt\.dot ", ttgir))
    copies = len(re.findall(r"ttg\.async_copy_global_to_local", ttgir))
    stores = len(re.findall(r"ttg\.local_store", ttgir))
    allocs = len(re.findall(r"ttg\.local_alloc", ttgir))
    return f"wgdot {wg} dot {mma2} acp {copies} lst {stores} lalloc {allocs}"


def compile_ptx(args) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("--ptx compiles: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    dump = Path(args.dump) if args.dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    keys = list(PTX_COUNTS)
    print(f"sm_90 (Triton {triton.__version__}), bf16 queries, e4m3 cache, page 64, R 512 + 64; key loop of one "
          "iteration (PTX's largest loop)")  # fmt: skip
    header = (f"{'variant':38} | {'regs':>8} {'smem':>6} | {'ttgir':40} | {'loop':>5} "
              + " ".join(f"{SHORT[k]:>5}" for k in keys))  # fmt: skip
    print(header, flush=True)
    results = []
    for v in ptx_variants(args):
        heads = 16 if v.block_h == 16 else 128
        t0 = time.time()
        try:
            compiled = compile_variant(v, heads)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            print(f"{v.name:38} | COMPILE FAILED {msg}", flush=True)
            results.append({**asdict(v), "name": v.name, "error": msg})
            continue
        ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
        if dump:
            stem = v.name.replace(" ", "_")
            (dump / f"{stem}.ptx").write_text(ptx)
            (dump / f"{stem}.ttgir").write_text(ttgir)
        loop = main_loop(ptx)
        c = count(loop)
        regs = ptxas_registers(ptx) if not args.no_ptxas else "-"
        smem = compiled.metadata.shared
        tg = ttgir_summary(ttgir, v.stages)
        row = {
            **asdict(v),
            "name": v.name,
            "registers": regs,
            "shared": smem,
            "ttgir": tg,
            "loop_len": len(loop),
            "loop": c,
            "kernel": count(ptx_instructions(ptx.splitlines())),
            "compile_s": round(time.time() - t0, 1),
        }
        results.append(row)
        print(f"{v.name:38} | {regs:>8} {smem:6} | {tg:40} | {len(loop):5} "
              + " ".join(f"{c[k]:5}" for k in keys), flush=True)  # fmt: skip
    print("wg8/wg16: wgmma e4m3 / 16-bit; mma(8): mma.sync (e4m3); lds8/sts8: 8-bit shared loads/stores; lds/sts: "
          "all; ldmx(T): ldmatrix (.trans); stmx: stmatrix; cvt<8 / cvt>8: conversions from / to e4m3x2; cpas: "
          "cp.async; tma: cp.async.bulk; ttgir: warp_group_dot / tt.dot (mma v2) / async copies / local_store / "
          "local_alloc in the TTGIR")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


# ----------------------------------------------------------------------------------------------- --bench


V3 = {"vload": 3, "vchunk": 16}
V4 = {"vload": 4, "vchunk": 16}
_MODES = [(vl, st, acc) for vl in (V3, V4) for st in (2, 3) for acc in ("two", "inplace")]
BENCH_VARIANTS = {
    16: [Variant(True, 16, 64, 8, st, acc, True, **vl) for vl, st, acc in _MODES]
    + [Variant(True, 16, 64, 4, 2, "two", True, **V3), Variant(True, 16, 64, 4, 2, "two", True, maxnreg=128, **V3),
       Variant(True, 16, 32, 8, 3, "two", True, **V3), Variant(True, 16, 32, 4, 3, "two", True, **V3),
       Variant(True, 16, 64, 4, 2, "two", True), Variant(True, 16, 64, 8, 2, "two", True),
       Variant(False, 16, 64, 4, 2, "two", True), Variant(False, 16, 32, 4, 3, "two", True)],
    128: [Variant(True, 64, 64, 8, st, acc, True, **vl) for vl, st, acc in _MODES]
    + [Variant(True, 64, 64, 8, 2, "promote", True, **V3), Variant(True, 64, 64, 4, 2, "inplace", True, **V3),
       Variant(True, 64, 64, 8, 2, "inplace", True), Variant(False, 64, 64, 8, 2, "inplace", True)],
}  # fmt: skip


def bench(args) -> int:
    from portattn.bench.ceilings import measure_ceilings
    from portattn.kernels.triton.mla_decode_launch import mla_decode_forward
    from portattn.mla import plan_mla_decode

    t_start = time.time()
    dev = torch.device("cuda")
    B, L, P, scale = args.batch, args.seq_len, 64, 0.07
    env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    fp8_bytes = B * L * 576
    copy_tb_s = measure_ceilings(dev, copy_bytes=1 << 30, n=1024).copy_tb_s
    print(f"{env}; B={B} L={L} P={P}; fp8 cache {fp8_bytes / 1e6:.0f} MB; copy {copy_tb_s:.2f} TB/s "
          f"(fp8 cache once at copy speed: {fp8_bytes / copy_tb_s / 1e9:.4f} ms)", flush=True)  # fmt: skip
    rows = []
    for heads in args.heads_list:
        s = make_case([L] * B, heads, P, torch.bfloat16, dev, seed=heads)
        kv_scale = s["kv_scale"]
        meta = plan_mla_decode(s["page_table"], s["seq_lens"], P, num_heads=heads, kv_lora_rank=512, max_seqlen_k=L)
        splits = meta.num_kv_splits
        n = 4  # sequences in the error check
        small = {k: s[k][:n] for k in ("qn", "qr", "page_table", "seq_lens")}
        ref8 = reference(small["qn"], small["qr"], s["c8"], small["page_table"], small["seq_lens"], scale=scale,
                         kv_scale=kv_scale)  # fmt: skip
        out = torch.empty_like(s["qn"])
        base = {}
        for label, kv, ks in (("bf16", s["cache"], 1.0), ("e4m3", s["c8"], kv_scale)):
            fn = functools.partial(mla_decode_forward, s["qn"], s["qr"], kv, s["page_table"], s["seq_lens"], out,
                                   scale=scale, num_kv_splits=splits, partials=meta.partials, kv_scale=ks)  # fmt: skip
            ms = graph_ms(fn, dev)
            got = mla_decode_forward(
                small["qn"],
                small["qr"],
                kv,
                small["page_table"],
                small["seq_lens"],
                torch.empty_like(small["qn"]),
                scale=scale,
                num_kv_splits=1,
                kv_scale=ks,
            )
            base[label] = ms
            e = rel_err(got, ref8)
            rows.append({"heads": heads, "name": f"production {label}", "ms": ms, "rel_err": e, "splits": splits})
            print(f"H={heads:3} production {label:30} {splits:2} splits {ms:.4f} ms  x bf16 "
                  f"{base['bf16'] / ms:.2f}  rel err {e:.2e}", flush=True)  # fmt: skip
        variants = BENCH_VARIANTS[heads] if not args.only_first else BENCH_VARIANTS[heads][:1]
        for v in variants:
            if v.maxnreg is None and args.maxnreg:
                v = replace(v, maxnreg=args.maxnreg)
            try:
                got = probe_forward(small["qn"], small["qr"], s["c8"], small["page_table"], small["seq_lens"],
                                    torch.empty_like(small["qn"]), scale=scale, kv_scale=kv_scale, num_kv_splits=1,
                                    v=v)  # fmt: skip
                torch.cuda.synchronize()
                e = rel_err(got, ref8)
                fn = functools.partial(probe_forward, s["qn"], s["qr"], s["c8"], s["page_table"], s["seq_lens"], out,
                                       scale=scale, kv_scale=kv_scale, num_kv_splits=splits, v=v,
                                       partials=meta.partials)  # fmt: skip
                ms = graph_ms(fn, dev)
                got_all = fn()
                torch.cuda.synchronize()
                e_split = rel_err(got_all[:n], ref8)
            except Exception as exc:
                msg = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                rows.append({"heads": heads, "name": v.name, "error": msg})
                print(f"H={heads:3} {v.name:41} FAILED {msg}", flush=True)
                continue
            frac = fp8_bytes / ms / 1e9 / copy_tb_s
            rows.append({"heads": heads, "name": v.name, **asdict(v), "ms": ms, "rel_err": e, "rel_err_split": e_split,
                         "x_bf16": base["bf16"] / ms, "frac_copy": frac, "splits": splits})  # fmt: skip
            print(f"H={heads:3} {v.name:41} {ms:.4f} ms  x bf16 {base['bf16'] / ms:.2f}  {frac:4.0%} of copy  "
                  f"rel err {e:.2e} / split {e_split:.2e}", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"env": env, "copy_tb_s": copy_tb_s, "rows": rows}, indent=1))
    print(f"{time.time() - t_start:.0f} s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--ptx", action="store_true")
    mode.add_argument("--bench", action="store_true")
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 32, 128], help="--ptx")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="--ptx")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="--ptx")
    parser.add_argument("--acc", nargs="+", default=["two"], choices=list(ACC_MODES), help="--ptx")
    parser.add_argument("--pages", nargs="+", default=["tile", "keys"], choices=["tile", "keys"], help="--ptx")
    parser.add_argument("--vload", type=int, nargs="+", default=[0, 3], help="--ptx: T's value-tile loads")
    parser.add_argument("--vchunk", type=int, nargs="+", default=[16], help="--ptx: vload 3's chunks")
    parser.add_argument("--transposed", nargs="+", default=["T", "N"], choices=["T", "N"], help="--ptx")
    parser.add_argument("--block-h", type=int, nargs="+", default=[16, 64], help="--ptx")
    parser.add_argument("--maxnreg", type=int, default=None, help="--ptx / --bench: register cap")
    parser.add_argument("--no-ptxas", action="store_true")
    parser.add_argument("--dump", default=None, help="--ptx: write PTX/TTGIR here")
    parser.add_argument("--heads", type=int, default=None, help="--check: query heads (default 16)")
    parser.add_argument("--quick", action="store_true", help="--check: two variants only")
    parser.add_argument("--tol", type=float, default=5e-2, help="--check: relative error tolerance")
    parser.add_argument("--heads-list", type=int, nargs="+", default=[16, 128], help="--bench")
    parser.add_argument("--only-first", action="store_true", help="--bench: one variant a head count")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        return check(args)
    if args.ptx:
        return compile_ptx(args)
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
