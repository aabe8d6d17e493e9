"""Where an MLA decode step's time goes between the kernel and the split merge: for each case, graph replays of the
whole call (``mla_decode_forward`` with the plan's splits), of the call without its merge kernel, and of the merge
kernel alone over the same partials: ``PYTHONPATH=src python3 parts.py [HEADS ...]``."""

import sys

import torch

from portattn.bench.timing import measure_graph
from portattn.kernels.triton import mla_decode_launch
from portattn.kv_quant import quantize_kv
from portattn.mla import plan_mla_decode


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def time_case(kv_name, kv, kv_scale, heads, tables, lens, gen, dev) -> str:
    b, L, P = lens.numel(), int(lens[0]), kv.shape[1]
    merge = mla_decode_launch.mla_decode_merge_kernel
    qn = torch.randn(b, heads, 512, device=dev, dtype=torch.bfloat16, generator=gen)
    qr = torch.randn(b, heads, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(qn)
    meta = plan_mla_decode(tables[0], lens, P, num_heads=heads, kv_lora_rank=512, max_seqlen_k=L)

    def call(i):
        mla_decode_launch.mla_decode_forward(qn, qr, kv, tables[i], lens, out, scale=0.07,
                                             num_kv_splits=meta.num_kv_splits, partials=meta.partials,
                                             kv_scale=kv_scale, fewer_splits=meta.splits_chosen)  # fmt: skip

    whole = measure_graph(call, [0, 1, 2, 3], dev)
    mla_decode_launch.mla_decode_merge_kernel = _NoLaunch()
    try:
        alone = measure_graph(call, [0, 1, 2, 3], dev)
    finally:
        mla_decode_launch.mla_decode_merge_kernel = merge
    tiles = mla_decode_launch.choose_tiles(heads, qn.dtype, interpret=False, kv_dtype=kv.dtype, batch=b)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = meta.num_kv_splits
    if tiles.wide or tiles.fp8_mma:
        programs = b * -(-heads // tiles.block_h)
        splits = mla_decode_launch.fp8_mma_splits(splits, programs, sms * mla_decode_launch.programs_an_sm(tiles))
    line = (f"{kv_name} B={b} L={L} heads {heads} splits {splits}: whole {whole.median_ms:.4f} ms"
            f" (spread {whole.spread:.1%}), without the merge {alone.median_ms:.4f}")  # fmt: skip
    if splits > 1:
        part_out = meta.partials[0].view(-1)[: b * heads * splits * 512].view(b, heads, splits, 512)
        part_lse = meta.partials[1].view(-1)[: b * heads * splits].view(b, heads, splits)

        def merge_only(_):
            merge[(heads, b)](part_out, part_lse, lens, out, out[:, :, 0], heads, splits, *out.stride(),
                              *out[:, :, 0].stride(), KV_LORA_RANK=512, BLOCK_R=512, SPLIT_ALIGN=tiles.block_n,
                              WRITE_LSE=False, MIN_SPLIT=meta.min_split_keys, num_warps=4)  # fmt: skip

        line += f", the merge alone {measure_graph(merge_only, [0], dev).median_ms:.4f}"
    return line


def main() -> None:
    heads_list = [int(h) for h in sys.argv[1:]] or [17, 32, 64, 128]
    dev = torch.device("cuda")
    b, L, P = 64, 4096, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    pages = b * L // P * 4  # four page tables over one pool: past the L2
    cache = torch.randn(pages, P, 576, device=dev, dtype=torch.bfloat16, generator=gen)
    tables = [torch.randperm(pages, device=dev, generator=gen)[: b * L // P].view(b, L // P).to(torch.int32)
              for _ in range(4)]  # fmt: skip
    lens = torch.full((b,), L, device=dev, dtype=torch.int32)
    for kv_name in ("bf16", "e4m3"):
        kv, kv_scale = (cache, 1.0) if kv_name == "bf16" else (quantize_kv(cache, torch.float8_e4m3fn, 0.05), 0.05)
        for heads in heads_list:
            print(time_case(kv_name, kv, kv_scale, heads, tables, lens, gen, dev), flush=True)


if __name__ == "__main__":
    main()
