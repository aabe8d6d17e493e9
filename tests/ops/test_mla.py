"""MLA decode against the float64 reference: page sizes, head counts, split counts, workspace, validation.

Fixtures place latent pages in random order, poison every slot no sequence owns with NaN, and fill
the unused tail of each page-table row with a NaN page and an out-of-range id, so that a read past
a sequence's keys shows as NaN (or an error) instead of a plausible number. The latent is small
here (rank 32, rope 16) to keep the CPU interpreter fast; the GPU run covers DeepSeek's 512 / 64.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import portattn
from conftest import DEVICE, backend_dtype_params
from portattn import UnsupportedFeatureError
from portattn.backends import registry
from portattn.backends.base import AttentionBackend, Capabilities
from portattn.backends.cache import LatentKVCache
from portattn.backends.torch_ref import TorchBackend
from portattn.kernels.triton.mla_workspace import MAX_KV_SPLITS, choose_num_kv_splits
from portattn.mla import mla_workspace_size, plan_mla_decode, split_latent
from portattn.testing import max_error, mla_decode_ref, tolerance

RANK, ROPE = 32, 16
BACKEND_DTYPES = backend_dtype_params("mla_decode")
SPLITTING_BACKENDS = sorted({p.values[0] for p in BACKEND_DTYPES} - {"torch"})  # backends that use the workspace


@dataclass(eq=False)
class MLACase:
    q_nope: torch.Tensor
    q_rope: torch.Tensor
    kv_cache: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor

    def inputs(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")}


def make_mla_case(
    seq_lens: list[int],
    *,
    page_size: int,
    num_heads: int,
    rank: int = RANK,
    rope_dim: int = ROPE,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = DEVICE,
    seed: int = 0,
    spare_pages: int = 2,
) -> MLACase:
    """Sequences in shuffled pages; NaN in every unowned slot; each row's tail = [NaN page, bad id]."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages + 1
    order = torch.randperm(num_pages, generator=gen).tolist()
    junk_page = order.pop()
    width = max(pages_per_seq, default=0) + 2
    page_table = torch.full((len(seq_lens), width), junk_page, dtype=torch.int32)
    page_table[:, -1] = num_pages + 5  # out of range: must never be read
    kv_cache = torch.full((num_pages, page_size, rank + rope_dim), float("nan"))
    for b, (n, npages) in enumerate(zip(seq_lens, pages_per_seq)):
        pages = [order.pop() for _ in range(npages)]
        page_table[b, :npages] = torch.tensor(pages, dtype=torch.int32)
        rows = torch.randn(n, rank + rope_dim, generator=gen)
        for j, page in enumerate(pages):
            chunk = rows[j * page_size : (j + 1) * page_size]
            kv_cache[page, : chunk.shape[0]] = chunk
    batch = len(seq_lens)
    q_nope = torch.randn(batch, num_heads, rank, generator=gen)
    q_rope = torch.randn(batch, num_heads, rope_dim, generator=gen)
    return MLACase(
        q_nope=q_nope.to(dtype).to(device),
        q_rope=q_rope.to(dtype).to(device),
        kv_cache=kv_cache.to(dtype).to(device),
        page_table=page_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def lengths(page_size: int) -> list[int]:
    """An empty sequence, lengths 1, P-1, P, P+1, and one of several pages."""
    p = page_size
    return [0, 1, max(p - 1, 1), p, p + 1, 3 * p + 5]


def check(case: MLACase, backend: str, dtype: torch.dtype, scale: float = 0.2, **kwargs) -> torch.Tensor:
    out = portattn.mla_decode(**case.inputs(), scale=scale, backend=backend, **kwargs)
    ref = mla_decode_ref(**case.inputs(), scale=scale)
    lowp = mla_decode_ref(**case.inputs(), scale=scale, upcast=False)
    err, tol = max_error(out, ref), tolerance(ref, lowp, dtype)
    assert out.dtype == dtype and out.shape == case.q_nope.shape
    assert err <= tol, f"max error {err:.3e} > tolerance {tol:.3e}"
    return out


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_matches_reference(backend, dtype, page_size):
    case = make_mla_case(lengths(page_size), page_size=page_size, num_heads=16, dtype=dtype)
    out = check(case, backend, dtype)
    assert bool((out[0] == 0).all()), "a sequence with no keys returns zeros"


@pytest.mark.parametrize("num_heads", [1, 5, 128])
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_head_counts(backend, dtype, num_heads):
    case = make_mla_case([3, 40], page_size=16, num_heads=num_heads, dtype=dtype, seed=num_heads)
    check(case, backend, dtype, num_kv_splits=2)


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_split_counts_agree(backend, dtype):
    """Any split count (more than a short sequence has blocks, too) gives the same result within rounding."""
    case = make_mla_case([2, 17, 300], page_size=16, num_heads=4, dtype=dtype, seed=7)
    ref = mla_decode_ref(**case.inputs(), scale=0.2)
    lowp = mla_decode_ref(**case.inputs(), scale=0.2, upcast=False)
    outs = {splits: check(case, backend, dtype, num_kv_splits=splits) for splits in (1, 2, 3, 7, MAX_KV_SPLITS)}
    for splits, out in outs.items():
        assert max_error(out, outs[1]) <= 2 * tolerance(ref, lowp, dtype), f"{splits} splits vs 1"


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_odd_latent_widths(backend, dtype):
    """Rank and rope dim that are not powers of two (the kernel pads and masks them)."""
    case = make_mla_case([5, 33], page_size=7, num_heads=3, rank=24, rope_dim=8, dtype=dtype, seed=3)
    check(case, backend, dtype, scale=0.3, num_kv_splits=3)


def test_choose_num_kv_splits_from_the_problem():
    # A small batch over a long sequence is split; a large batch or a short sequence is not.
    assert choose_num_kv_splits(32768, 1, 16) == MAX_KV_SPLITS
    assert choose_num_kv_splits(4096, 64, 16) == 4
    assert choose_num_kv_splits(4096, 256, 16) == 1
    assert choose_num_kv_splits(64, 1, 16) == 1
    assert choose_num_kv_splits(300, 1, 16) == 5  # as many as 300 keys fill at MIN_SPLIT_TOKENS (64) a split
    # Many heads: two 64-head blocks a sequence, splits up to about 128 programs.
    assert choose_num_kv_splits(4096, 64, 128) == 1
    assert choose_num_kv_splits(32768, 64, 128) == 1
    assert choose_num_kv_splits(4096, 32, 128) == 2
    assert choose_num_kv_splits(4096, 8, 128) == 8
    assert choose_num_kv_splits(4096, 1, 128) == MAX_KV_SPLITS
    assert choose_num_kv_splits(1536, 1, 128) == 24  # the length's bound: 64 keys a split
    for args in [(0, 0, 1), (1, 1, 1), (10**6, 1, 1), (10**6, 10**4, 128)]:
        assert 1 <= choose_num_kv_splits(*args) <= MAX_KV_SPLITS


@pytest.mark.skipif("triton" not in SPLITTING_BACKENDS, reason="triton backend not available here")
def test_chosen_splits_cut_a_sequence_alike_for_any_bound():
    """A plan for the batch's longest sequence and one for a longer bound (a captured graph's) choose other
    split counts, and cut each sequence alike (at least MIN_SPLIT_TOKENS keys a split): equal outputs, bit for
    bit; forced counts cut at the tile only."""
    from portattn.backends.triton import TritonBackend
    from portattn.kernels.triton.mla_workspace import MIN_SPLIT_TOKENS

    dtype = torch.float16
    case = make_mla_case([40, 150, 300], page_size=16, num_heads=4, dtype=dtype, seed=21)
    outs, splits = [], []
    for bound in (300, 4096):
        plan = plan_mla_decode(case.page_table, case.seq_lens, 16, num_heads=4, kv_lora_rank=RANK, max_seqlen_k=bound)
        assert plan.min_split_keys == MIN_SPLIT_TOKENS
        out = torch.full_like(case.q_nope, float("nan"))
        TritonBackend().mla_decode(case.q_nope, case.q_rope, case.kv_cache, plan, 0.2, out)
        outs.append(out)
        splits.append(plan.num_kv_splits)
    assert splits == [5, 64]
    assert torch.equal(outs[0], outs[1])
    forced = plan_mla_decode(case.page_table, case.seq_lens, 16, num_heads=4, kv_lora_rank=RANK, num_kv_splits=5)
    assert forced.min_split_keys == 1
    ref = mla_decode_ref(**case.inputs(), scale=0.2)
    lowp = mla_decode_ref(**case.inputs(), scale=0.2, upcast=False)
    assert max_error(outs[0], ref) <= tolerance(ref, lowp, dtype)


def test_workspace_size_is_a_pure_function():
    rank = 512
    for max_len, batch, heads in [(32768, 1, 16), (4096, 64, 16), (32768, 64, 128), (100, 3, 1)]:
        splits = choose_num_kv_splits(max_len, batch, heads)
        expected = 0 if splits == 1 else 4 * batch * heads * splits * (rank + 1)
        for page_size in (1, 16, 64):  # splits are cut in tokens: no page-size dependence
            assert mla_workspace_size(max_len, batch, heads, page_size) == expected
        assert mla_workspace_size(max_len, batch, heads, 16, num_kv_splits=splits, kv_lora_rank=rank) == expected
    assert mla_workspace_size(10, 2, 4, 1, num_kv_splits=3, kv_lora_rank=8) == 4 * 2 * 4 * 3 * 9
    assert mla_workspace_size(10, 2, 4, 1, num_kv_splits=1, kv_lora_rank=8) == 0
    sizes = [mla_workspace_size(n, 2, 16, 64) for n in range(0, 40000, 97)]
    assert sizes == sorted(sizes), "a bound on the length larger than needed always suffices"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_seq_len": -1}, "max_seq_len to be an int >= 0"),
        ({"batch_size": 1.5}, "batch_size to be an int"),
        ({"num_heads": 0}, "num_heads to be an int >= 1"),
        ({"page_size": 0}, "page_size to be an int >= 1"),
        ({"num_kv_splits": 0}, "num_kv_splits to be an int >= 1"),
        ({"kv_lora_rank": 0}, "kv_lora_rank to be an int >= 1"),
    ],
)
def test_workspace_size_validation(kwargs, message):
    args = {"max_seq_len": 100, "batch_size": 2, "num_heads": 4, "page_size": 16} | kwargs
    positional = [args.pop(n) for n in ("max_seq_len", "batch_size", "num_heads", "page_size")]
    with pytest.raises(ValueError, match=message):
        mla_workspace_size(*positional, **args)


@pytest.mark.parametrize("splits", [2, 5, None])
@pytest.mark.parametrize("backend", SPLITTING_BACKENDS)
def test_kernel_stays_inside_its_workspace(backend, splits):
    """The bytes after ``mla_workspace_size`` are never written; the bytes inside are used."""
    dtype = torch.float16
    seq_lens = [700, 33, 0, 260]
    case = make_mla_case(seq_lens, page_size=16, num_heads=3, dtype=dtype, seed=11)
    resolved = plan_mla_decode(
        case.page_table, case.seq_lens, 16, num_heads=3, kv_lora_rank=RANK, max_seqlen_k=max(seq_lens),
        num_kv_splits=splits,
    ).num_kv_splits  # fmt: skip
    assert resolved > 1
    size = mla_workspace_size(max(seq_lens), len(seq_lens), 3, 16, num_kv_splits=splits or -1, kv_lora_rank=RANK)
    poison = 0xA5
    buf = torch.full((size + 4096,), poison, dtype=torch.uint8, device=DEVICE)
    check(case, backend, dtype, num_kv_splits=splits, workspace=buf)
    assert bool((buf[size:] == poison).all()), "written past the workspace"
    assert bool((buf[:size] != poison).any()), "workspace not used"


def test_workspace_too_small_is_rejected():
    case = make_mla_case([300], page_size=16, num_heads=2)
    size = mla_workspace_size(300, 1, 2, 16, num_kv_splits=4, kv_lora_rank=RANK)
    small = torch.empty(size - 1, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=f"expected a workspace of at least {size} bytes"):
        portattn.mla_decode(**case.inputs(), scale=0.1, num_kv_splits=4, workspace=small)


def _mutate(name):
    """Validation cases: (inputs -> inputs with one thing wrong, kwargs, message)."""

    def replace(**changes):
        return lambda c: c.inputs() | {k: (v(c) if callable(v) else v) for k, v in changes.items()}

    table = {
        "q_nope not a tensor": (replace(q_nope=[1.0]), {}, "expected q_nope to be a torch.Tensor"),
        "q_nope 2-D": (replace(q_nope=lambda c: c.q_nope[0]), {}, "expected q_nope with 3 dims"),
        "q_nope int": (replace(q_nope=lambda c: c.q_nope.int()), {}, "expected q_nope of dtype"),
        "q_rope dtype": (replace(q_rope=lambda c: c.q_rope.half()), {}, "expected q_rope of dtype float32"),
        "q_rope heads": (replace(q_rope=lambda c: c.q_rope[:, :1]), {}, r"expected q_rope of shape \[2, 4, rope_dim\]"),
        "kv width": (replace(kv_cache=lambda c: c.kv_cache[..., :-1]), {}, "expected kv_cache rows of kv_lora_rank"),
        "kv dtype": (replace(kv_cache=lambda c: c.kv_cache.double()), {}, "expected kv_cache of dtype float32"),
        "kv 4-D": (replace(kv_cache=lambda c: c.kv_cache[:, :, None]), {}, "expected kv_cache with 3 dims"),
        "table int64": (replace(page_table=lambda c: c.page_table.long()), {}, "expected page_table of dtype int32"),
        "table rows": (replace(page_table=lambda c: c.page_table[:1]), {}, "expected page_table with 2 rows"),
        "table narrow": (replace(page_table=lambda c: c.page_table[:, :1]), {}, "expected page_table with at least"),
        "lens int64": (replace(seq_lens=lambda c: c.seq_lens.long()), {}, "expected seq_lens of dtype int32"),
        "lens count": (replace(seq_lens=lambda c: c.seq_lens[:1]), {}, r"expected seq_lens of shape \[2\]"),
        "lens negative": (
            replace(seq_lens=lambda c: torch.tensor([-1, 3], dtype=torch.int32, device=DEVICE)),
            {},
            "expected seq_lens >= 0",
        ),
        "page out of range": (
            replace(page_table=lambda c: c.page_table.clone().index_fill_(1, torch.tensor([0], device=DEVICE), 999)),
            {},
            r"expected page ids in \[0, \d+\) for used pages, got 999",
        ),
        "scale zero": (replace(), {"scale": 0.0}, "expected a positive finite scale"),
        "scale nan": (replace(), {"scale": float("nan")}, "expected a positive finite scale"),
        "splits zero": (replace(), {"num_kv_splits": 0}, "expected num_kv_splits to be an int >= 1"),
        "workspace dtype": (
            replace(),
            {"num_kv_splits": 2, "workspace": torch.empty(1 << 16, dtype=torch.float32, device=DEVICE)},
            "expected workspace of dtype uint8",
        ),
    }
    return table[name]


@pytest.mark.parametrize(
    "name",
    [
        "q_nope not a tensor", "q_nope 2-D", "q_nope int", "q_rope dtype", "q_rope heads", "kv width", "kv dtype",
        "kv 4-D", "table int64", "table rows", "table narrow", "lens int64", "lens count", "lens negative",
        "page out of range", "scale zero", "scale nan", "splits zero", "workspace dtype",
    ],
)  # fmt: skip
def test_validation(name):
    make_inputs, kwargs, message = _mutate(name)
    case = make_mla_case([5, 20], page_size=8, num_heads=4)
    kwargs = {"scale": 0.1, "backend": "torch"} | kwargs
    with pytest.raises(ValueError, match=message):
        portattn.mla_decode(**make_inputs(case), **kwargs)


class _NoMLABackend(AttentionBackend):
    name = "no_mla"
    capabilities = Capabilities(ops=frozenset({"paged_attention"}))


def test_backend_without_mla_raises_unsupported_feature(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "no_mla", registry._Entry("no_mla", "test_mla:_NoMLABackend"))
    monkeypatch.setitem(registry._CLASSES, "no_mla", _NoMLABackend)
    case = make_mla_case([5], page_size=4, num_heads=2)
    with pytest.raises(UnsupportedFeatureError, match="does not support the mla_decode op") as info:
        portattn.mla_decode(**case.inputs(), scale=0.1, backend="no_mla")
    assert "torch" in info.value.supported_by


def test_latent_helpers_move_rows_exactly():
    page_size, rank, rope = 4, 6, 2
    cache = torch.full((5, page_size, rank + rope), float("nan"))
    slots = torch.tensor([13, 2, 7])
    c_kv, k_pe = torch.randn(3, rank), torch.randn(3, rope)
    TorchBackend().write_latent(c_kv, k_pe, LatentKVCache(cache), slots)
    got_c, got_pe = split_latent(cache, rank)
    assert torch.equal(got_c.flatten(0, 1)[slots], c_kv)
    assert torch.equal(got_pe.flatten(0, 1)[slots], k_pe)
    assert int(torch.isnan(cache).flatten(0, 1).all(dim=1).sum()) == 5 * page_size - 3


@pytest.mark.parametrize(("block_h", "block_n"), [(16, 32), (32, 16), (64, 32)])
@pytest.mark.skipif("triton" not in SPLITTING_BACKENDS, reason="triton backend not available here")
def test_triton_tile_configs(block_h, block_n):
    """The tiles the GPU uses (wider head and key blocks) compute the same function."""
    from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward

    dtype = torch.float16
    case = make_mla_case([1, 50, 129], page_size=16, num_heads=40, dtype=dtype, seed=5)
    ref = mla_decode_ref(**case.inputs(), scale=0.2)
    lowp = mla_decode_ref(**case.inputs(), scale=0.2, upcast=False)
    for splits in (1, 3):
        plan = plan_mla_decode(
            case.page_table, case.seq_lens, 16, num_heads=40, kv_lora_rank=RANK, num_kv_splits=splits
        )
        out = torch.full_like(case.q_nope, float("nan"))
        mla_decode_forward(
            case.q_nope, case.q_rope, case.kv_cache, case.page_table, case.seq_lens, out, scale=0.2,
            num_kv_splits=splits, workspace=plan.workspace, tiles=MLATileConfig(block_h, block_n),
        )  # fmt: skip
        assert max_error(out, ref) <= tolerance(ref, lowp, dtype)


@pytest.mark.skipif("triton" not in SPLITTING_BACKENDS, reason="triton backend not available here")
def test_triton_launcher_rejects_bad_inputs():
    """The per-layer launcher checks cheaply, but still says what is wrong."""
    from portattn.kernels.triton.mla_decode_launch import mla_decode_forward

    case = make_mla_case([5, 20], page_size=8, num_heads=4)
    out = torch.empty_like(case.q_nope)
    args = (case.q_nope, case.q_rope, case.kv_cache, case.page_table, case.seq_lens)
    with pytest.raises(ValueError, match="expected seq_lens_k of dtype int32"):
        mla_decode_forward(*args[:4], case.seq_lens.long(), out, scale=0.1, num_kv_splits=1)
    with pytest.raises(ValueError, match=r"expected out of shape \[2, 4, 32\]"):
        mla_decode_forward(*args, out[:, :2], scale=0.1, num_kv_splits=1)
    with pytest.raises(ValueError, match="expected a uint8 workspace of at least"):
        mla_decode_forward(*args, out, scale=0.1, num_kv_splits=2, workspace=None)


@pytest.mark.parametrize("cache", ["float16", "fp8_e4m3"])
@pytest.mark.skipif("triton" not in SPLITTING_BACKENDS, reason="triton backend not available here")
def test_triton_latent_rows_loaded_again_for_the_values(cache):
    """``MLATileConfig.separate_values`` (the value product's latent rows loaded a second time) and
    ``dequantize_once`` (a tile converted to 16 bits once for both products) equal the plain launch bit
    for bit, with splits and without, at a rank that leaves masked columns in the tile (24 of 32), NaN in
    every unowned slot."""
    from portattn.kernels.triton.mla_decode_launch import MLATileConfig, mla_decode_forward
    from portattn.kv_quant import quantize_kv

    case = make_mla_case([1, 20, 45], page_size=8, num_heads=5, rank=24, dtype=torch.float16, seed=9)
    kv, scale = case.kv_cache, 1.0
    if cache == "fp8_e4m3":
        kv, scale = quantize_kv(case.kv_cache, torch.float8_e4m3fn, 0.5), 0.5
    plain = MLATileConfig(16, 16, num_warps=4, num_stages=2)
    for splits in (1, 3):
        plan = plan_mla_decode(case.page_table, case.seq_lens, 8, num_heads=5, kv_lora_rank=24, num_kv_splits=splits)
        outs = []
        variants = [dataclasses.replace(plain, separate_values=True), dataclasses.replace(plain, dequantize_once=True)]
        for tiles in (plain, *variants):
            out = torch.full_like(case.q_nope, float("nan"))
            mla_decode_forward(
                case.q_nope, case.q_rope, kv, case.page_table, case.seq_lens, out, scale=0.2,
                num_kv_splits=splits, workspace=plan.workspace, tiles=tiles, kv_scale=scale,
            )  # fmt: skip
            outs.append(out)
        for other in outs[1:]:
            assert not other.isnan().any() and torch.equal(other, outs[0])
    ref_cache = kv.to(torch.float16) * scale
    ref = mla_decode_ref(**{**case.inputs(), "kv_cache": ref_cache}, scale=0.2)
    assert max_error(outs[1], ref) < 5e-3


@pytest.mark.skipif("triton" not in SPLITTING_BACKENDS, reason="triton backend not available here")
def test_triton_default_tiles_over_an_fp8_cache():
    """The GPU's tiles over an fp8 latent cache: few heads load the latent rows again for the values,
    64-head blocks take 64-key tiles in 2 stages; 16-bit caches keep theirs. Both fp8 tiles compute
    the dequantized cache's attention (with splits and without)."""
    from portattn.kernels.triton.mla_decode_launch import MLATileConfig, choose_tiles, mla_decode_forward
    from portattn.kv_quant import quantize_kv

    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    few, many = MLATileConfig(16, 32, 4, 3, separate_values=True), MLATileConfig(64, 64, 8, 2)
    assert choose_tiles(16, bf16, interpret=False, kv_dtype=e4m3, fp8_mma=False) == few
    assert choose_tiles(128, bf16, interpret=False, kv_dtype=e4m3, wide=False) == many
    assert choose_tiles(16, bf16, interpret=False) == MLATileConfig(16, 32, 4, 3)  # 16-bit: unchanged
    assert choose_tiles(128, bf16, interpret=False, kv_dtype=bf16, wide=False) == MLATileConfig(64, 32, 8, 3)
    assert choose_tiles(16, torch.float32, interpret=False, kv_dtype=e4m3) == MLATileConfig(16, 32, 4, 3)

    case = make_mla_case([1, 40, 97], page_size=16, num_heads=20, rank=64, dtype=torch.float16, seed=4)
    kv = quantize_kv(case.kv_cache, e4m3, 0.5)
    ref = mla_decode_ref(**{**case.inputs(), "kv_cache": kv.to(torch.float16) * 0.5}, scale=0.2)
    for tiles in (few, many):
        for splits in (1, 2):
            plan = plan_mla_decode(
                case.page_table, case.seq_lens, 16, num_heads=20, kv_lora_rank=64, num_kv_splits=splits
            )
            out = torch.full_like(case.q_nope, float("nan"))
            mla_decode_forward(
                case.q_nope, case.q_rope, kv, case.page_table, case.seq_lens, out, scale=0.2,
                num_kv_splits=splits, workspace=plan.workspace, tiles=tiles, kv_scale=0.5,
            )  # fmt: skip
            assert max_error(out, ref) < 5e-3, (tiles, splits)
