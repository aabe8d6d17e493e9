"""Benchmark of ``paged_attention`` (Triton backend): decode, long decode, page sizes, prefill, extend.

Every case is a uniform batch (B sequences, n new tokens over L keys each) in pages placed at
random in one pool; the Triton backend is planned once and its per-layer method is timed, as an
engine calls it. Peers run on the same numbers gathered into contiguous ``[B, H, L, D]`` tensors.
An fp8 case (``kv_cache``) stores the same keys and values in fp8 (bytes counted at one per
element) and is compared with the same call on the model-dtype cache, planned for that cache (peer
``portattn_bf16``: its own split count and tiles). Its V cache is stored as the engine's pool stores
it (``runtime.kv_cache.FP8_V_KEYS_CONTIGUOUS``: each page's keys contiguous, or rows of a key); the
other layout is timed beside it (peer ``portattn_fp8_v_keys`` or ``portattn_fp8_v_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.base import AttentionParams
from ..backends.torch_ref import TorchBackend
from ..kernels.triton.launch import TileConfig, attention_forward
from ..kv_quant import KV_CACHE_DTYPES, quantize_kv
from ..runtime import kv_cache as kv_pool
from . import peers
from .timing import measure, measure_steady, num_input_sets
from .work import count_work


@dataclass(frozen=True)
class PagedCase:
    name: str
    batch: int
    q_len: int
    k_len: int
    page_size: int = 16
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    window_left: int = -1
    peers: tuple[str, ...] = ("cudnn", "flash", "flex")
    torch_backend: bool = False  # the reference backend is timed only where it is tolerable
    kv_cache: str | None = None  # "fp8_e4m3" / "fp8_e5m2": the cache in fp8 (scales K_SCALE, V_SCALE)

    @property
    def mode(self) -> str:
        if self.q_len == 1:
            return "decode"
        return "prefill" if self.q_len == self.k_len else "extend"


# FlexAttention compiles once per shape (tens of seconds): it is timed where a target names it.
CASES = [
    PagedCase("decode B=64 L=4096 P=16", 64, 1, 4096, peers=("cudnn", "flash"), torch_backend=True),
    PagedCase("decode B=64 L=4096 P=64", 64, 1, 4096, page_size=64, peers=()),
    PagedCase("decode B=64 L=4096 P=1", 64, 1, 4096, page_size=1, peers=()),
    PagedCase("fp8 e4m3 decode B=64 L=4096 P=16", 64, 1, 4096, peers=(), kv_cache="fp8_e4m3"),
    PagedCase("fp8 e5m2 decode B=64 L=4096 P=16", 64, 1, 4096, peers=(), kv_cache="fp8_e5m2"),
    PagedCase("decode B=1 L=65536 P=16", 1, 1, 65536, peers=("cudnn", "flash"), torch_backend=True),
    # An engine's common decode: short contexts at small batches, where a step is launch- and latency-bound.
    PagedCase("decode B=1 L=1024 P=16", 1, 1, 1024, peers=("cudnn", "flash")),
    PagedCase("decode B=8 L=1024 P=16", 8, 1, 1024, peers=("cudnn", "flash")),
    # The decodes of a served step (about 20-30 sequences over 1k keys), beside a prompt's chunk or alone.
    PagedCase("decode B=24 L=1024 P=16", 24, 1, 1024, peers=("cudnn", "flash")),
    PagedCase("prefill B=1 L=8192 causal", 1, 8192, 8192),
    PagedCase("extend B=8 512 over 8192", 8, 512, 8192 + 512, torch_backend=True),
]

# Alternatives timed with --sweep: (block_m or None for the default, block_n, num_warps, num_stages).
LONG_TILES = [
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 32, 8, 3),
    (128, 32, 8, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 4, 3),
    (128, 128, 4, 2),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (64, 32, 4, 4),
    (64, 64, 4, 2),
    (128, 32, 4, 3),
]
SMEM_BUDGET = 200 * 1024  # bytes of K/V stages a swept tile may ask for (the H200 has 227 KB per SM)
K_SCALE, V_SCALE = 0.5, 0.25  # fp8 cases: stored values are 2x / 4x the keys / values


def sweep_tiles(case: PagedCase) -> list[tuple[int | None, int, int, int]]:
    """Tile shapes to time for one case: a full grid for the batched decode, a few for the other decodes."""
    if case.mode != "decode":
        tiles = LONG_TILES
    elif case.batch > 1 and case.page_size == 16:
        tiles = [(None, n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]
    else:
        tiles = [(None, 32, 4, 4), (None, 64, 4, 4), (None, 64, 8, 4), (None, 64, 8, 5), (None, 128, 4, 3)]
    kv_bytes = 1 if case.kv_cache else 2
    return [t for t in tiles if t[3] * t[1] * 2 * case.head_dim * kv_bytes <= SMEM_BUDGET]


def _inputs(case: PagedCase, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    b, n, L, p = case.batch, case.q_len, case.k_len, case.page_size
    pages_per_seq = -(-L // p)
    num_pages = b * pages_per_seq + 8
    perm = torch.randperm(num_pages, generator=gen, device=device)
    page_table = perm[: b * pages_per_seq].view(b, pages_per_seq).to(torch.int32)  # [B, pages]
    shape = (num_pages, p, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(b * n, case.num_q_heads, case.head_dim, generator=gen, device=device, dtype=dtype)

    def contiguous(cache):  # [B, Hkv, L, D]
        rows = cache[page_table.long()].flatten(1, 2)[:, :L]  # [B, L, Hkv, D]
        return rows.transpose(1, 2).contiguous()

    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "page_table": page_table}
    if case.kv_cache is not None:  # the case times the fp8 cache; its peer the model-dtype one
        kv_dtype = KV_CACHE_DTYPES[case.kv_cache]
        v_rows = quantize_kv(v_cache, kv_dtype, V_SCALE)
        v_keys = kv_pool.keys_contiguous(v_rows)
        pool_layout = kv_pool.FP8_V_KEYS_CONTIGUOUS and p > 1
        inputs |= {
            "k_cache": quantize_kv(k_cache, kv_dtype, K_SCALE),
            "v_cache": v_keys if pool_layout else v_rows,
            "v_cache_other": v_rows if pool_layout else v_keys,
        }
        inputs |= {"k_cache_model": k_cache, "v_cache_model": v_cache}
    elif case.peers:
        inputs |= {
            "q4": q.view(b, n, case.num_q_heads, case.head_dim).transpose(1, 2).contiguous(),  # [B, Hq, n, D]
            "k4": contiguous(k_cache),
            "v4": contiguous(v_cache),
        }
    return inputs


def run_case(
    case: PagedCase, device: torch.device, *, dtype=torch.bfloat16, sweep: bool = False, graph: bool = False
) -> dict:
    """Time one case. ``graph``: every call (ours and the peers') as CUDA-graph replays
    (``timing.measure_graph``: steady enough for a 0.1 ms call); else in bursts (``timing.measure``)."""
    from ..backends.triton import TritonBackend

    timer = measure_steady if graph else measure

    elt = torch.tensor([], dtype=dtype).element_size()
    kv_elt = 1 if case.kv_cache else elt
    per_set = (2 * kv_elt + (elt if case.peers else 0)) * case.batch * case.k_len * case.num_kv_heads * case.head_dim
    sets = [_inputs(case, dtype, device, seed) for seed in range(num_input_sets(per_set))]
    b = case.batch
    cu_q = torch.arange(0, b + 1, device=device, dtype=torch.int32) * case.q_len
    seq_lens_k = torch.full((b,), case.k_len, device=device, dtype=torch.int32)
    scale = case.head_dim**-0.5
    params = AttentionParams(scale=scale, window_left=case.window_left)
    if case.kv_cache:
        params = AttentionParams(scale=scale, window_left=case.window_left, k_scale=K_SCALE, v_scale=V_SCALE)
    work = count_work(
        [case.q_len] * b,
        [case.k_len] * b,
        num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        value_dim=case.head_dim,
        element_size=elt,
        kv_element_size=kv_elt,
        window_left=case.window_left,
        page_table_bytes=sets[0]["page_table"].numel() * 4,
    )
    out = torch.empty(b * case.q_len, case.num_q_heads, case.head_dim, device=device, dtype=dtype)
    idx = list(range(len(sets)))

    triton_backend = TritonBackend()
    metadata = triton_backend.plan_paged(
        cu_q, seq_lens_k, sets[0]["page_table"], case.page_size, num_heads=case.num_q_heads,
        kv_dtype=sets[0]["k_cache"].dtype,
    )  # fmt: skip
    ours = lambda i: triton_backend.paged_attention(
        sets[i]["q"], sets[i]["k_cache"], sets[i]["v_cache"], metadata, params, out
    )
    result = {
        "op": "paged_attention",
        "case": case.name,
        "mode": case.mode,
        "flops": work.flops,
        "bytes": work.bytes,
        "num_kv_splits": metadata.num_kv_splits,
        "peers": {},
    }
    timing = timer(ours, idx, device)
    result |= {"portattn_ms": timing.median_ms, "portattn_spread": timing.spread}
    result["timing"] = "graph" if graph else "burst"
    if case.kv_cache:  # the same call on the model-dtype cache, planned for it: what fp8 buys
        model_params = AttentionParams(scale=scale, window_left=case.window_left)
        model_metadata = triton_backend.plan_paged(
            cu_q, seq_lens_k, sets[0]["page_table"], case.page_size, num_heads=case.num_q_heads,
            kv_dtype=sets[0]["k_cache_model"].dtype,
        )  # fmt: skip
        same_in_bf16 = lambda i: triton_backend.paged_attention(
            sets[i]["q"], sets[i]["k_cache_model"], sets[i]["v_cache_model"], model_metadata, model_params, out
        )
        result["peers"]["portattn_bf16"] = timer(same_in_bf16, idx, device).median_ms
        other_layout = lambda i: triton_backend.paged_attention(
            sets[i]["q"], sets[i]["k_cache"], sets[i]["v_cache_other"], metadata, params, out
        )
        other = "portattn_fp8_v_rows" if sets[0]["v_cache_other"].is_contiguous() else "portattn_fp8_v_keys"
        result["peers"][other] = timer(other_layout, idx, device).median_ms

    qs, ks, vs = ([s.get(key) for s in sets] for key in ("q4", "k4", "v4"))
    for name in case.peers:
        if name == "flex":
            peer = peers.flex_peer(qs, ks, vs, mode=case.mode, scale=scale)
        else:
            peer = peers.sdpa_peer(name, qs, ks, vs, mode=case.mode, scale=scale)
        result["peers"][name] = peer if isinstance(peer, str) else timer(peer, idx, device).median_ms
    if case.torch_backend:
        ref_backend = TorchBackend()
        ref_meta = ref_backend.plan_paged(cu_q, seq_lens_k, sets[0]["page_table"], case.page_size)
        ref = lambda i: ref_backend.paged_attention(
            sets[i]["q"], sets[i]["k_cache"], sets[i]["v_cache"], ref_meta, params, out
        )
        result["peers"]["torch_backend"] = measure(ref, idx, device, warmup=1, runs=3).median_ms

    if sweep:
        result["sweep"], result["sweep_table"] = _sweep(case, sets, cu_q, seq_lens_k, metadata, scale, device, timer)
    return result


def _sweep(case, sets, cu_q, seq_lens_k, metadata, scale, device, timer=measure) -> tuple[dict, dict]:
    """Median ms of other tile shapes and split counts (same kernel, launched directly, timed by
    ``timer`` as the case is), and what the tile table needs of them (``tile_table.updated``): the
    case's problem class, the rules' tiles and their time, and each tile shape's time at the plan's
    split count. The table is written from graph timings (``--graph``): in bursts a call of tens of
    microseconds is timed at the host's launch pace, whatever its tiles."""
    from ..kernels.triton import tile_table
    from ..kernels.triton.launch import MAX_KV_SPLITS, choose_tiles, default_tiles, tile_class

    group = case.num_q_heads // case.num_kv_heads
    default = choose_tiles(case.q_len, group, case.head_dim, case.head_dim, interpret=False)
    out = torch.empty(sets[0]["q"].shape, device=device, dtype=sets[0]["q"].dtype)
    variants = {}
    splits = metadata.num_kv_splits
    tile_list = sweep_tiles(case)
    if case.batch > 1 and case.k_len > 2048:
        split_list = sorted({1, 2, 4, splits})
    else:  # one sequence, or short contexts: fewer and more splits than chosen (up to MAX_KV_SPLITS)
        split_list = sorted(
            {max(splits // 4, 1), max(splits // 2, 1), splits} | {min(splits * m, MAX_KV_SPLITS) for m in (2, 4, 8)}
        )
    s0 = sets[0]
    launch_args = (s0["q"], s0["k_cache"], s0["v_cache"], case.batch, case.q_len, case.k_len, splits)
    rules = default_tiles(*launch_args, swept=False)
    problem = tile_class(*launch_args[:3], default_tiles(*launch_args, swept=False, fit=False))
    table = {"key": problem, "rule": tile_table.entry_of(rules), "candidates": []}
    trials = [(t, splits) for t in tile_list] + [(None, s) for s in split_list] + [(rules, splits)]
    if case.mode == "decode":  # deeper pipelines with more splits
        trials += [((None, 64, 4, 4), s) for s in split_list if s != splits]
    for tile, num_kv_splits in trials:
        if tile is None:
            tiles = default
        elif isinstance(tile, TileConfig):
            tiles = tile
        else:
            block_m = tile[0] or default.block_m
            tiles = TileConfig(block_m // (default.block_m // default.block_q), block_m, tile[1], tile[2], tile[3])
        key = f"m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages} splits{num_kv_splits}"
        fn = lambda i, tiles=tiles, num_kv_splits=num_kv_splits: attention_forward(
            sets[i]["q"], sets[i]["k_cache"], sets[i]["v_cache"], out, cu_q, seq_lens_k,
            max_seqlen_q=case.q_len, scale=scale, page_table=sets[i]["page_table"],
            window_left=case.window_left, num_kv_splits=num_kv_splits, tiles=tiles,
            **({"k_scale": K_SCALE, "v_scale": V_SCALE} if case.kv_cache else {}),
        )  # fmt: skip
        if tile is rules:
            key = f"rules {key}{' ahead' if tiles.pages_ahead else ''}"
        try:
            variants[key] = timer(fn, list(range(len(sets))), device, runs=20).median_ms
        except Exception as exc:  # a tile shape that does not compile here is reported
            variants[key] = peers.error_line(exc)
            continue
        if tile is rules:
            table["rule_ms"] = variants[key]
        elif num_kv_splits == splits:
            table["candidates"].append([tile_table.entry_of(tiles), variants[key]])
    return variants, table
