"""Benchmark of ``varlen_attention`` (Triton backend): a vision-encoder batch, non-causal.

16 sequences of 1k-4k tokens (fixed seed), 16 heads of dim 80, packed ``[T, H, D]``. Peers:
torch's FlashAttention varlen, SDPA looped per sequence, portattn's torch backend, and (with
``flex=True``; its compile takes tens of seconds) FlexAttention with a document mask on the
packed tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..backends.base import AttentionParams
from ..backends.torch_ref import TorchBackend
from ..testing import cu_seqlens
from . import peers
from .paged_attention import LONG_TILES
from .timing import measure, measure_steady, num_input_sets
from .work import count_work


@dataclass(frozen=True)
class VarlenCase:
    name: str
    num_seqs: int = 16
    min_len: int = 1024
    max_len: int = 4096
    num_heads: int = 16
    head_dim: int = 80
    seed: int = 0

    def lengths(self) -> list[int]:
        rng = random.Random(self.seed)
        return [rng.randint(self.min_len, self.max_len) for _ in range(self.num_seqs)]


CASES = [VarlenCase("varlen encoder 16 x 1k-4k H=16 D=80")]


def run_case(
    case: VarlenCase,
    device: torch.device,
    *,
    dtype=torch.bfloat16,
    sweep: bool = False,
    flex: bool = False,
    graph: bool = False,
) -> dict:
    """Time one case (``graph``: as CUDA-graph replays, see ``paged_attention.run_case``)."""
    from ..backends.triton import TritonBackend

    timer = measure_steady if graph else measure

    lens = case.lengths()
    total = sum(lens)
    elt = torch.tensor([], dtype=dtype).element_size()
    shape = (total, case.num_heads, case.head_dim)
    n_sets = num_input_sets(3 * total * case.num_heads * case.head_dim * elt)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    qs, ks, vs = ([torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(n_sets)] for _ in "qkv")
    cu = cu_seqlens(lens, device)
    scale = case.head_dim**-0.5
    params = AttentionParams(scale=scale, causal=False)
    work = count_work(
        lens, lens, num_q_heads=case.num_heads, num_kv_heads=case.num_heads, head_dim=case.head_dim,
        value_dim=case.head_dim, element_size=elt, causal=False,
    )  # fmt: skip
    idx = list(range(n_sets))
    out = torch.empty(shape, device=device, dtype=dtype)
    backend = TritonBackend()
    metadata = backend.plan_varlen(cu, cu)
    ours = lambda i: backend.varlen_attention(qs[i], ks[i], vs[i], metadata, params, out)
    result = {
        "op": "varlen_attention",
        "case": case.name,
        "mode": "varlen",
        "flops": work.flops,
        "bytes": work.bytes,
        "peers": {},
    }
    timing = timer(ours, idx, device)
    result |= {"portattn_ms": timing.median_ms, "portattn_spread": timing.spread}
    result["timing"] = "graph" if graph else "burst"
    bounds = [(int(a), int(b)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    candidates = {
        "flash_varlen": peers.flash_varlen_peer(qs, ks, vs, cu, max(lens), scale=scale),
        "sdpa_loop": peers.sdpa_loop_peer(qs, ks, vs, bounds, scale=scale),
    }
    if flex:
        doc_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        q4, k4, v4 = (
            [t[i].transpose(0, 1).unsqueeze(0).contiguous() for i in idx] for t in (qs, ks, vs)
        )  # [1, H, T, D]
        candidates["flex"] = peers.flex_peer(q4, k4, v4, mode="varlen", scale=scale, doc_ids=doc_ids)
    ref_backend = TorchBackend()
    ref_meta = ref_backend.plan_varlen(cu, cu)
    candidates["torch_backend"] = lambda i: ref_backend.varlen_attention(qs[i], ks[i], vs[i], ref_meta, params, out)
    for name, peer in candidates.items():
        runs = 3 if name == "torch_backend" else 50
        time_peer = measure if name == "torch_backend" else timer  # the reference syncs: no graph
        result["peers"][name] = peer if isinstance(peer, str) else time_peer(peer, idx, device, runs=runs).median_ms
    if sweep:
        result["sweep"] = _sweep(case, qs, ks, vs, cu, max(lens), scale, device)
    return result


def _sweep(case, qs, ks, vs, cu, max_len, scale, device) -> dict:
    from ..kernels.triton.launch import TileConfig, attention_forward

    out = torch.empty_like(qs[0])
    seq_lens_k = cu[1:] - cu[:-1]
    variants = {}
    for block_m, block_n, warps, stages in LONG_TILES:
        tiles = TileConfig(block_m, block_m, block_n, warps, stages)
        fn = lambda i, tiles=tiles: attention_forward(
            qs[i], ks[i], vs[i], out, cu, seq_lens_k, max_seqlen_q=max_len, scale=scale, kv_start=cu[:-1],
            causal=False, tiles=tiles,
        )  # fmt: skip
        key = f"m{block_m} n{block_n} w{warps} s{stages}"
        try:
            variants[key] = measure(fn, list(range(len(qs))), device, runs=20).median_ms
        except Exception as exc:
            variants[key] = peers.error_line(exc)
    return variants
