"""The seesaw MLA kernel over an fp8 cache (``mla_decode_seesaw_fp8``): what it needs, and its code compiled for
Hopper on any machine. Its results are checked on the GPU by ``test_mla_wide_fp8.py``'s fp8-values test, which runs
it (``SEESAW``) wherever TMA copies 64-key tiles."""

from __future__ import annotations

import textwrap

import pytest
import torch

from kernels.mla_checks import run_compile_child
from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw

HOPPER_SHARED = 232_448  # bytes of shared memory a program may take on compute capability 9.0


def test_seesaw_names_what_it_needs():
    """A 16-bit cache, pages TMA cannot copy as 64-key tiles, a ring past shared memory and another form's options
    are refused with what the kernel expects."""
    assert "expected an fp8 cache" in seesaw.supports(torch.zeros(4, 64, 576, dtype=torch.bfloat16))
    fp8 = torch.zeros(4, 7, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 7 keys a page: no whole tiles
    assert "expected a cache TMA can copy" in seesaw.supports(fp8)
    assert seesaw.supports(torch.zeros(4, 64, 576, dtype=torch.uint8).view(torch.float8_e5m2)) is None
    rest = {"q_scale": 1.0, "qk_scale_log2": 1.0, "kv_scale": 1.0, "num_kv_splits": 1, "write_partial": False,
            "write_lse": False, "min_split": 0}  # fmt: skip
    with pytest.raises(ValueError, match="expected a cache TMA can copy"):
        seesaw.launch_arguments(*[None] * 2, fp8, *[None] * 6, **rest)
    whole = torch.zeros(4, 64, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected a ring of at most 3 slots \(Hopper's shared memory\), got 4"):
        seesaw.launch_arguments(*[None] * 2, whole, *[None] * 6, **rest, ring=4)
    with pytest.raises(ValueError, match=r"expected 64-key tiles, fp8 values, .* got block_n=32, fp8_values=True"):
        seesaw.launch_arguments(*[None] * 2, whole, *[None] * 6, **rest, block_n=32)
    with pytest.raises(ValueError, match="pipelined=True"):
        seesaw.launch_arguments(*[None] * 2, whole, *[None] * 6, **rest, pipelined=True)


@pytest.mark.parametrize("form", ["seesaw", "vregs"])
def test_the_launch_arguments_fill_the_kernel_parameters(form):
    """A seesaw kernel's launch arguments (built on any machine, CPU tensors) fill its parameters exactly: as many
    positional arguments as it has parameters before its constexprs, then each constexpr by name, none missing or
    left over; the grid is ``[head blocks of 64, splits, sequences]``."""
    from portattn.kernels.triton import mla_decode_seesaw_vregs as vregs

    module, kernel = {"seesaw": (seesaw, seesaw.mla_decode_seesaw_kernel),
                      "vregs": (vregs, vregs.mla_decode_seesaw_vregs_kernel)}[form]  # fmt: skip
    batch, heads, splits = 3, 100, 2
    q_nope = torch.zeros(batch, heads, 512, dtype=torch.bfloat16)
    q_rope = torch.zeros(batch, heads, 64, dtype=torch.bfloat16)
    kv_cache = torch.zeros(8, 64, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    page_table, seq_lens = torch.zeros(batch, 2, dtype=torch.int32), torch.full((batch,), 100, dtype=torch.int32)
    out, lse = torch.zeros_like(q_nope), torch.zeros(batch, heads)
    part_out, part_lse = torch.zeros(batch, heads, splits, 512), torch.zeros(batch, heads, splits)
    grid, args, kwargs = module.launch_arguments(
        q_nope, q_rope, kv_cache, page_table, seq_lens, out, lse, part_out, part_lse,
        q_scale=1.0, qk_scale_log2=1.0, kv_scale=1.0, num_kv_splits=splits, write_partial=True, write_lse=True,
        min_split=64,
    )  # fmt: skip
    named = set(kwargs) - {"num_warps", "maxnreg"}  # launch options, not parameters
    assert list(kernel.arg_names[len(args) :]) == [n for n in kernel.arg_names if n in named], (kernel.arg_names, named)
    assert len(args) + len(named) == len(kernel.arg_names), (len(args), sorted(named), kernel.arg_names)
    assert grid == (2, splits, batch)


@pytest.mark.parametrize("one_pass", [False, True])
def test_the_launch_takes_the_query_rows_its_heads_need(monkeypatch, one_pass):
    """``ONE_PASS``: a launch of at most 16 heads rounds 16 head rows in one pass, of 17-32 heads 32, of more the head
    block's 64 in two passes; without it, 64 always (``Q_ROWS``, through :func:`query_rows`)."""
    monkeypatch.setattr(seesaw, "ONE_PASS", one_pass)
    kv_cache = torch.zeros(8, 64, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    page_table, seq_lens = torch.zeros(2, 2, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32)
    for heads, rows in ((1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64), (100, 64)):
        q_nope = torch.zeros(2, heads, 512, dtype=torch.bfloat16)
        q_rope = torch.zeros(2, heads, 64, dtype=torch.bfloat16)
        out, lse = torch.zeros_like(q_nope), torch.zeros(2, heads)
        _, _, kwargs = seesaw.launch_arguments(
            q_nope, q_rope, kv_cache, page_table, seq_lens, out, lse, out, lse, q_scale=1.0, qk_scale_log2=1.0,
            kv_scale=1.0, num_kv_splits=1, write_partial=False, write_lse=True, min_split=64,
        )  # fmt: skip
        assert kwargs["Q_ROWS"] == (rows if one_pass else 64), heads


def test_the_merge_reads_bf16_partials_from_the_first_half_of_the_float32_buffer(device):
    """``bf16_partials`` (``BF16_PARTIALS``) is the float32 partials buffer's first half of bytes in its shape, and
    the merge kernel given it merges as a float64 merge of those bfloat16 values does (on the GPU where there is one,
    else interpreted): the splits weighed by their LSEs, the empty splits past a short sequence skipped, the second
    half of the buffer (NaN here) never read."""
    from portattn.kernels.triton.mla_decode import mla_decode_merge_kernel

    batch, heads, splits, rank = 3, 5, 3, 512
    part_out = torch.full((batch, heads, splits, rank), float("nan"), device=device)
    written = seesaw.bf16_partials(part_out)
    assert (written.dtype, written.shape, written.data_ptr()) == (torch.bfloat16, part_out.shape, part_out.data_ptr())
    written.copy_(torch.randn(batch, heads, splits, rank, generator=torch.Generator().manual_seed(0)))
    assert part_out.view(-1)[part_out.numel() // 2 :].isnan().all()  # the second half untouched
    part_lse = (torch.randn(batch, heads, splits, generator=torch.Generator().manual_seed(1)) * 4).to(device)
    seq_lens = torch.tensor([300, 64, 0], dtype=torch.int32, device=device)  # 2 active splits of 256 keys, 1, none
    out = torch.full((batch, heads, rank), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((batch, heads), float("nan"), device=device)
    mla_decode_merge_kernel[(heads, batch)](
        written, part_lse, seq_lens, out, lse, heads, splits, *out.stride(), *lse.stride(),
        KV_LORA_RANK=rank, BLOCK_R=rank, SPLIT_ALIGN=64, WRITE_LSE=True, MIN_SPLIT=256,
    )  # fmt: skip
    for b, active in enumerate((2, 1, 0)):
        if active == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()
            continue
        weights = torch.softmax(part_lse[b, :, :active].double() * 0.6931471805599453, dim=-1)  # base-2 LSEs
        want = (weights[..., None] * written[b, :, :active].double()).sum(1)
        want_lse = torch.logsumexp(part_lse[b, :, :active].double() * 0.6931471805599453, dim=-1)
        # one bfloat16 rounding (the interpreter's may truncate): within one unit in the last place
        assert ((out[b].double() - want).abs() <= 2.0**-7 * want.abs() + 1e-12).all(), b
        assert (lse[b].double() - want_lse).abs().max() <= 1e-5 * want_lse.abs().max(), b


def test_the_transposed_values_and_the_probabilities_hold_the_keys_in_one_order():
    """``key_columns`` (``TRANS_LOAD``) is a permutation of a tile's keys, and the order both sides of the value
    product take: the probabilities' (``_publish_probabilities``: ``[heads, k32 k16 k8 k4 k2 k1]`` permuted to ``[heads,
    k4 k2 k32 k16 k8 k1]``) and the producer's 16-bit columns (``_transpose_values``: ``[k32 k16 k4 k2 k8]`` a column,
    keys ``k, k + 1`` in each)."""
    order = seesaw.key_columns()
    assert sorted(order) == list(range(64)) and order[:4] == [0, 1, 8, 9]
    keys = torch.arange(64).reshape(2, 2, 2, 2, 2, 2)  # k32 k16 k8 k4 k2 k1
    assert keys.permute(3, 4, 0, 1, 2, 5).reshape(64).tolist() == order
    pairs = keys[..., 0].permute(3, 4, 0, 1, 2).reshape(32)  # an element's first key, [k4 k2 k32 k16 k8]
    assert torch.stack((pairs, pairs + 1), 1).reshape(64).tolist() == order


def test_seesaw_with_values_from_registers_names_what_it_needs():
    """``mla_decode_seesaw_vregs`` refuses what the seesaw kernel refuses, and a ring past shared memory (its ring
    takes the value buffers' place: 4 slots by default, also where the launcher asks for the other forms' 3)."""
    from portattn.kernels.triton import mla_decode_seesaw_vregs as vregs

    assert vregs.supports is seesaw.supports
    assert vregs.shared_bytes(vregs.RING) <= HOPPER_SHARED < vregs.shared_bytes(vregs.RING + 1)
    rest = {"q_scale": 1.0, "qk_scale_log2": 1.0, "kv_scale": 1.0, "num_kv_splits": 1, "write_partial": False,
            "write_lse": False, "min_split": 0}  # fmt: skip
    fp8 = torch.zeros(4, 7, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="expected a cache TMA can copy"):
        vregs.launch_arguments(*[None] * 2, fp8, *[None] * 6, **rest)
    whole = torch.zeros(4, 64, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected a ring of at most 4 slots \(Hopper's shared memory\), got 5"):
        vregs.launch_arguments(*[None] * 2, whole, *[None] * 6, **rest, ring=5)
    with pytest.raises(ValueError, match=r"expected 64-key tiles, fp8 values, .* got block_n=32, fp8_values=True"):
        vregs.launch_arguments(*[None] * 2, whole, *[None] * 6, **rest, block_n=32)


CHILD = textwrap.dedent(
    """
    import re, sys
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 (Gluon's Hopper API)
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from kernels.mla_checks import cache_descriptors, compile_for_hopper, serialized_mma_notes, stack_bytes
    from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw, mla_decode_seesaw_vregs as vregs

    KERNEL, CONSTEXPRS, NUM_WARPS = {KERNEL}
    # the seesaw kernel's partial outputs as the launcher passes them (BF16_PARTIALS)
    part = "*bf16" if KERNEL is seesaw.mla_decode_seesaw_kernel and seesaw.BF16_PARTIALS else "*fp32"
    ptrs = {"QNope": "*bf16", "QRope": "*bf16", "PageTable": "*i32", "SeqLensK": "*i32", "Out": "*bf16",
            "Lse": "*fp32", "PartOut": part, "PartLse": "*fp32"}
    for kv, page_size in (("*fp8e4nv", 64), ("*fp8e5", 16)):
        const = {**CONSTEXPRS(), "PAGE_SIZE": page_size, "WRITE_PARTIAL": True, "WRITE_LSE": True,
                 "MIN_SPLIT": 256, "TMA_ROWS": min(page_size, 64)}
        if KERNEL is seesaw.mla_decode_seesaw_kernel:  # 32 head rows in one pass (ONE_PASS) over 64-key pages, 64
            # in two over 16-key ones
            const["Q_ROWS"] = 32 if page_size == 64 else 64
        kernel = compile_for_hopper(KERNEL, {**ptrs, "KV": kv}, const,
                                    {"num_warps": NUM_WARPS, "maxnreg": seesaw.PRODUCER_MAXNREG},
                                    cache_descriptors(kv, min(page_size, 64), const))
        ptx = kernel.asm["ptx"]
        b = "e4m3" if kv == "*fp8e4nv" else "e5m2"
        counts = {name: len(re.findall(rx, ptx)) for name, rx in (
            # the scores: e4m3 queries against the cache, both operands in shared memory (descriptors)
            ("scores", rf"wgmma\\.mma_async\\.sync\\.aligned\\.m64n64k32\\.f32\\.e4m3\\.{b}\\s+{{[^}}]*}},\\s*%rd"),
            # the values: e4m3 probabilities against transposed values in shared memory (seesaw) ...
            ("values", rf"wgmma\\.mma_async\\.sync\\.aligned\\.m64n256k32\\.f32\\.e4m3\\.{b}"),
            # ... or the cache's bytes in registers against the probabilities (vregs)
            ("register_values",
             rf"wgmma\\.mma_async\\.sync\\.aligned\\.m64n64k32\\.f32\\.{b}\\.e4m3\\s+{{[^}}]*}},\\s*{{"),
            ("wgmma", r"wgmma\\.mma_async"), ("tma", r"cp\\.async\\.bulk\\.tensor\\.2d"),
            ("copies", r"cp\\.async\\.cg\\.shared\\.global"), ("byte_loads", r"ld\\.shared\\.[ub]8"),
            # the producer's transposing loads (TRANS_LOAD) and 16-bit shared loads
            ("trans_loads", r"ldmatrix\\.sync\\.aligned\\.m8n8\\.x4\\.trans\\.shared\\.b16"),
            ("short_loads", r"ld\\.shared(\\.v\\d)?\\.[ub]16"),
            # the queries loaded again for their second pass (volatile loads)
            ("reloads", r"ld\\.volatile\\.global"),
            # the partial outputs' stores, four dims a thread: bfloat16 (two words) or float32 (four)
            ("bf16_partials", r"st\\.global\\.v2\\.b32"), ("f32_partials", r"st\\.global\\.v4\\.b32"))}
        counts["pairs_to_dims"] = ptx.count("0x6420;")  # the producer's regrouping (_PAIRS_TO_DIMS)
        counts["transposes"] = ptx.count("prmt.b32 t0,")  # vregs' 4x4 byte transposes (_TRANSPOSE_4X4)
        # the blocks whose register products take their operands as the transposes leave them: no byte shuffled
        # or selected outside the inline assembly
        counts["plain_blocks"] = 0
        for block in re.split(r"\\n\\$L__BB\\d+_\\d+:", ptx):
            if re.search(r"wgmma\\.mma_async[^\\n]*\\},\\s*\\{", block):
                outside = re.sub(r"// begin inline asm.*?// end inline asm", "", block, flags=re.S)
                counts["plain_blocks"] += not re.search(r"\\b(prmt|selp)\\.b", outside)
        regs = sorted(set(int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)))
        notes = serialized_mma_notes(kernel)
        print("kernel", kv, page_size, f"warps={kernel.metadata.num_warps}", f"shared={kernel.metadata.shared}",
              f"stack={stack_bytes(kernel)}", f"regs={','.join(map(str, regs))}",
              " ".join(f"{k}={v}" for k, v in counts.items()), f"serialized={-1 if notes is None else len(notes)}",
              flush=True)
    """
)


def compiled_counts(tmp_path, kernel: str) -> list[tuple[str, str, dict]]:
    """``(cache, page size, counts)`` of ``kernel`` (``seesaw`` or ``vregs``) compiled for sm_90 over an e4m3 cache
    of 64-key pages and an e5m2 one of 16-key pages (:data:`CHILD`)."""
    spec = {
        "seesaw": "seesaw.mla_decode_seesaw_kernel, seesaw.seesaw_constexprs, seesaw.NUM_WARPS",
        "vregs": "vregs.mla_decode_seesaw_vregs_kernel, vregs.vregs_constexprs, vregs.NUM_WARPS",
    }[kernel]
    lines = run_compile_child(tmp_path, CHILD.replace("{KERNEL}", spec), f"compile_mla_{kernel}", timeout=900)
    kernels = [line.split() for line in lines if line.startswith("kernel ")]
    assert len(kernels) == 2, lines
    return [(kv, page_size, {k: int(v) if k != "regs" else v for k, v in (f.split("=") for f in fields)})
            for _, kv, page_size, *fields in kernels]  # fmt: skip


def test_the_seesaw_kernel_compiles_for_hopper(tmp_path):
    """Twelve warps (the left and right consuming warpgroups, the producer), ``setmaxnreg`` giving the producer
    ``PRODUCER_REGS`` and the right warpgroup ``CONSUMER_REGS``; a pair's scores as one ``m64n64`` fp8 product a
    warpgroup (16 + 2 MMAs of K 32, the cache's own type against e4m3 queries), its values as two ``m64n256k32``
    ones a tile a warpgroup (no float16 product); TMA copies of each page's latent and rope at the first ``RING``
    tiles' sites and the loop's, no ``cp.async``; the values transposed by ``ldmatrix``'s transposing loads and one
    ``prmt`` a word; the queries loaded once, 32 head rows in one pass (``ONE_PASS``) over 64-key pages, 64 in two over
    16-key ones (``KEEP_QUERIES``); within Hopper's shared memory; spills at most a few scalars."""
    for kv, page_size, counts in compiled_counts(tmp_path, "seesaw"):
        where = (kv, page_size, counts)
        assert counts["warps"] == 12 and seesaw.shared_bytes() <= counts["shared"] <= HOPPER_SHARED, where
        regs = {str(seesaw.PRODUCER_REGS.value), str(seesaw.CONSUMER_REGS.value)}
        assert regs <= set(counts["regs"].split(",")), where
        assert (counts["scores"], counts["values"]) == (2 * 18, 2 * 2 * 2), where
        assert counts["wgmma"] == counts["scores"] + counts["values"], where
        pages = 64 // min(int(page_size), 64)
        assert counts["tma"] == (seesaw.RING + 1) * pages * 2 and counts["copies"] == 0, where
        # the producer's transposition (TRANS_LOAD), each tile's branch (within the sequence or its last): 16
        # transposing loads (LLVM may merge the branches' first) and 32 regroupings (8 a 64-dim chunk), no byte or
        # 16-bit shared loads (one byte: the warp-specialization's own)
        assert 31 <= counts["trans_loads"] <= 32 and counts["pairs_to_dims"] == 2 * 32, where
        assert counts["byte_loads"] <= 1 and counts["short_loads"] == 0, where
        # each warpgroup's 64 x 256 partial outputs in bfloat16 (BF16_PARTIALS), 32 stores of four dims a thread
        assert (counts["bf16_partials"], counts["f32_partials"]) == (2 * 32, 0), where
        # a few addresses reloaded once a pair, no accumulator (Triton 3.9: 24-32 bytes, 3.6, the GPU machine's: 32;
        # 24 and 48 before the transposing loads, TRANS_LOAD).
        # The scores in two partial sums (_issue_scores_folded): with three, ptxas had too few registers and
        # serialized every product (its note C7512, 168-176 bytes of stack); promoting within the product
        # (max_num_imprecise_acc) serialized them too (C7514). The queries' two merged passes spilled 488 bytes
        # before _queries_fp8(RELOAD=True)
        # the queries loaded from memory once: 32 rows in one pass over 64-key pages (ONE_PASS), 64 in two over 16-key
        # ones, the second reading them from shared memory (KEEP_QUERIES), not with volatile loads
        assert counts["reloads"] == 0, where
        assert counts["stack"] <= 80, where
        assert counts["serialized"] <= 0, where  # -1: no ptxas to ask


def test_the_seesaw_kernel_with_values_from_registers_compiles_for_hopper(tmp_path):
    """``mla_decode_seesaw_vregs``: twelve warps, ``setmaxnreg`` giving the producer ``PRODUCER_REGS`` and the
    right warpgroup ``CONSUMER_REGS``; a pair's scores as in the seesaw kernel (16 + 2 ``m64n64k32`` fp8 products a
    warpgroup, both operands in shared memory), its values as ``m64n64k32`` products whose first operand (the
    cache's bytes) is in registers: 4 a 32-key half of a tile, two halves, two tiles, two warpgroups; no byte-wise
    shared loads (each thread loads 8 dims of a key at once and regroups them in its registers); TMA copies at the
    first ``RING`` tiles' sites and the loop's, no ``cp.async``; within Hopper's shared memory; no product serialized
    by ptxas, a few scalars of stack."""
    from portattn.kernels.triton import mla_decode_seesaw_vregs as vregs

    for kv, page_size, counts in compiled_counts(tmp_path, "vregs"):
        where = (kv, page_size, counts)
        assert counts["warps"] == 12 and vregs.shared_bytes() <= counts["shared"] <= HOPPER_SHARED, where
        regs = {str(vregs.PRODUCER_REGS.value), str(vregs.CONSUMER_REGS.value)}
        assert regs <= set(counts["regs"].split(",")), where
        # 4 a 32-key half, two halves, the tiles within the sequence and the last (their own branch), two tiles, two
        # warpgroups
        assert (counts["scores"], counts["register_values"], counts["values"]) == (36, 2 * 2 * 2 * 2 * 4, 0), where
        # the transposes: 4 a half's operand (16 registers), as many halves as above; the products of the tiles
        # within the sequence (one block a tile a warpgroup) take their registers from them as they are (joined by a
        # branch between tail and not, the operand's bytes went through 3 prmt each: 96 a tile, not 64)
        assert counts["transposes"] == 2 * 2 * 2 * 2 * 4 and counts["plain_blocks"] >= 4, where
        assert counts["wgmma"] == counts["scores"] + counts["register_values"], where
        assert counts["byte_loads"] <= 1, where  # one: the partitions' dispatch (warp_specialize) reads a byte
        pages = 64 // min(int(page_size), 64)
        assert counts["tma"] == (vregs.RING + 1) * pages * 2 and counts["copies"] == 0, where
        assert counts["stack"] <= 64, where  # Triton 3.6: 48-56 bytes, as the seesaw kernel's (the queries)
        assert counts["serialized"] <= 0, where  # -1: no ptxas to ask
