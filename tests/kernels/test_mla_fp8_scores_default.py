"""The fp8-scores form (``mla_decode_wide_fp8``) as the default MLA decode tiles over an fp8 cache: with fp8 values
(``WIDE_FP8_VALUES_TILES``: the seesaw kernel where TMA copies the cache) past 32 heads, and from 17 heads where
the batch holds ``WIDE_FP8_MIN_BATCH`` sequences (fewer keep the ``fp8_mma`` kernel).

On any machine: which problems the rules give it (and which they do not), the keywords that decline it, and the
launcher with the default tiles where the form cannot run (the interpreter, a GPU that is not Hopper, a Triton on
which the form's module does not import): the portable kernel's tiles run instead and give the float64 reference,
while the same tiles asked for explicitly name what is missing. The form's own results are
``test_mla_wide_fp8.py``'s GPU tests.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys

import pytest
import torch

from ops.test_mla import RANK, make_mla_case
from portattn.device import is_triton_interpreter
from portattn.kernels.triton import mla_decode_launch as launch
from portattn.kernels.triton.mla_decode_launch import (
    FP8_MMA_32_HEAD_TILES,
    FP8_MMA_TILES,
    WIDE_FP8_SCORES_TILES,
    WIDE_FP8_VALUES_TILES,
    WIDE_PRODUCER_TILES,
    MLATileConfig,
    choose_tiles,
    mla_decode_forward,
)
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.mla import plan_mla_decode
from portattn.testing import max_error, mla_decode_ref, tolerance

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HALF = [torch.bfloat16, torch.float16]
# the portable kernel's tiles for more than 32 heads over fp8 (the launcher's fallback), and the interpreter's
PORTABLE_FP8_TILES = MLATileConfig(64, 64, 8, 2)
INTERPRETER_TILES = MLATileConfig(16, 16, 4, 1)


def test_choose_tiles_keeps_its_keywords_and_adds_fp8_scores_and_fp8_values_last():
    names = list(inspect.signature(choose_tiles).parameters)
    assert names == ["num_heads", "dtype", "interpret", "kv_dtype", "fp8_mma", "wide", "batch", "fp8_scores",
                     "fp8_values"]  # fmt: skip


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_caches_above_32_heads_take_the_fp8_scores_form_with_fp8_values_by_default(kv_dtype):
    """33 to 128 heads of 16-bit queries over an fp8 cache: the fp8-scores form, with fp8 values (the launcher's
    seesaw kernel where TMA copies the cache) from ``WIDE_FP8_VALUES_MIN_BLOCKS`` sequences x 64-head blocks or
    where the batch is not known, float16 values below; ``fp8_values`` decides where given, ``fp8_scores=False``
    gives the warp-specialized 16-bit form, ``wide=False`` the portable tiles; the interpreter keeps its own."""
    assert launch.WIDE_FP8_SCORES and launch.WIDE_FP8_VALUES and launch.WIDE_FP8_VALUES_MIN_BLOCKS == 64
    assert MLATileConfig(64, 64, 8, 2, wide=True, producer=True, fp8_scores=True) == WIDE_FP8_SCORES_TILES
    assert dataclasses.replace(WIDE_FP8_SCORES_TILES, fp8_values=True) == WIDE_FP8_VALUES_TILES
    assert (WIDE_FP8_SCORES_TILES.fp8_values, WIDE_PRODUCER_TILES.fp8_scores) == (False, False)
    for heads in (33, 40, 64, 100, 128):
        for dtype in HALF:
            where = (heads, dtype, kv_dtype)
            assert choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype) == WIDE_FP8_VALUES_TILES, where
            blocks = -(-heads // 64)
            for batch in (1, 8, 31, 32, 63, 64, 1024):
                got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, batch=batch)
                expected = WIDE_FP8_VALUES_TILES if batch * blocks >= 64 else WIDE_FP8_SCORES_TILES
                assert got == expected, (where, batch)
                got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, batch=batch, fp8_values=True)
                assert got == WIDE_FP8_VALUES_TILES, (where, batch)
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, fp8_scores=True)
            assert got == WIDE_FP8_VALUES_TILES, where
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, fp8_values=False)
            assert got == WIDE_FP8_SCORES_TILES, where
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, fp8_scores=False)
            assert got == WIDE_PRODUCER_TILES, where
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, wide=True)
            assert got == WIDE_FP8_VALUES_TILES, where
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, wide=False)
            assert got == PORTABLE_FP8_TILES, where
            assert choose_tiles(heads, dtype, interpret=True, kv_dtype=kv_dtype) == INTERPRETER_TILES, where


def test_fp8_values_take_the_seesaw_kernel_where_the_cache_allows():
    wide_fp8 = pytest.importorskip("portattn.kernels.triton.mla_decode_wide_fp8")
    assert wide_fp8.SEESAW  # the launcher's form for fp8 values in 64-key tiles where TMA copies the cache


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
def test_17_to_32_heads_take_the_form_from_a_few_sequences_and_fewer_keep_the_fp8_mma_kernel(kv_dtype):
    """17-32 heads over an fp8 cache: the form's tiles from ``WIDE_FP8_MIN_BATCH`` sequences (or an unknown count;
    fp8 values from ``WIDE_FP8_VALUES_MIN_BLOCKS``), the fp8_mma kernel's below it, and whenever ``fp8_mma=True``
    or the form is declined; 16 heads or fewer keep the fp8_mma kernel."""
    assert launch.WIDE_FP8_MIN_BATCH == 8
    for dtype in HALF:
        for heads, batch, expected in (
            (32, None, WIDE_FP8_VALUES_TILES),
            (32, 64, WIDE_FP8_VALUES_TILES),
            (32, 8, WIDE_FP8_SCORES_TILES),
            (32, 63, WIDE_FP8_SCORES_TILES),
            (17, 64, WIDE_FP8_VALUES_TILES),
            (24, 1024, WIDE_FP8_VALUES_TILES),
            (32, 7, FP8_MMA_TILES),  # fewer sequences than FP8_MMA_32_HEAD_MIN_BATCH too
            (17, 1, FP8_MMA_TILES),
            (16, 64, FP8_MMA_TILES),
            (16, None, FP8_MMA_TILES),
            (2, None, FP8_MMA_TILES),
        ):
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, batch=batch)
            assert got == expected, (heads, batch, dtype)
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, batch=batch, fp8_scores=True)
            assert got == expected, (heads, batch, dtype)
        for heads, batch, expected in ((32, 64, FP8_MMA_32_HEAD_TILES), (32, 8, FP8_MMA_TILES), (17, None,
                                       FP8_MMA_32_HEAD_TILES)):  # fmt: skip
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, batch=batch, fp8_mma=True)
            assert got == expected, (heads, batch, dtype)
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, batch=batch, fp8_scores=False)
            assert got == expected, (heads, batch, dtype)
            got = choose_tiles(heads, dtype, interpret=False, kv_dtype=kv_dtype, batch=batch, wide=False)
            assert got == expected, (heads, batch, dtype)
        got = choose_tiles(32, dtype, interpret=False, kv_dtype=kv_dtype, batch=64, fp8_values=False)
        assert got == WIDE_FP8_SCORES_TILES
        # without the fp8_mma kernel, 17-32 heads take the wide kernel at any batch
        got = choose_tiles(32, dtype, interpret=False, kv_dtype=kv_dtype, fp8_mma=False, batch=1)
        assert got == WIDE_FP8_SCORES_TILES
        got = choose_tiles(32, dtype, interpret=False, kv_dtype=kv_dtype, fp8_mma=False)
        assert got == WIDE_FP8_VALUES_TILES
        got = choose_tiles(32, dtype, interpret=False, kv_dtype=kv_dtype, fp8_mma=False, fp8_scores=False)
        assert got == WIDE_PRODUCER_TILES
        got = choose_tiles(16, dtype, interpret=False, kv_dtype=kv_dtype, fp8_mma=False)
        assert got == MLATileConfig(16, 32, 4, 3, separate_values=True)  # 16 heads: never the wide kernel


def test_16_bit_caches_and_float32_queries_never_take_it():
    for dtype in HALF:
        for heads in (33, 64, 128):
            for fp8_scores in (None, True):
                got = choose_tiles(heads, dtype, interpret=False, kv_dtype=dtype, fp8_scores=fp8_scores)
                assert got == WIDE_PRODUCER_TILES, (heads, dtype, fp8_scores)
            assert choose_tiles(heads, dtype, interpret=False, fp8_scores=True) == WIDE_PRODUCER_TILES
    for kv_dtype in (*FP8, torch.float32):
        for heads in (33, 64, 128):
            for fp8_scores in (None, True):
                got = choose_tiles(heads, torch.float32, interpret=False, kv_dtype=kv_dtype, fp8_scores=fp8_scores)
                assert got == MLATileConfig(16, 32, 4, 3), (heads, kv_dtype, fp8_scores)


def test_the_switches_off_give_float16_values_and_the_warp_specialized_form_unless_asked(monkeypatch):
    monkeypatch.setattr(launch, "WIDE_FP8_VALUES", False)
    for kv_dtype in FP8:
        assert choose_tiles(64, torch.bfloat16, interpret=False, kv_dtype=kv_dtype) == WIDE_FP8_SCORES_TILES
        got = choose_tiles(64, torch.bfloat16, interpret=False, kv_dtype=kv_dtype, fp8_values=True)
        assert got == WIDE_FP8_VALUES_TILES
    monkeypatch.setattr(launch, "WIDE_FP8_SCORES", False)
    for kv_dtype in FP8:
        assert choose_tiles(64, torch.bfloat16, interpret=False, kv_dtype=kv_dtype) == WIDE_PRODUCER_TILES
        got = choose_tiles(64, torch.bfloat16, interpret=False, kv_dtype=kv_dtype, fp8_scores=True)
        assert got == WIDE_FP8_SCORES_TILES
        # the fp8_mma kernel keeps 17-32 heads at any batch
        got = choose_tiles(32, torch.bfloat16, interpret=False, kv_dtype=kv_dtype, batch=64)
        assert got == FP8_MMA_32_HEAD_TILES
    monkeypatch.setattr(launch, "WIDE_FP8", False)  # no wide kernel over fp8: the portable tiles, whatever asked
    got = choose_tiles(64, torch.bfloat16, interpret=False, kv_dtype=torch.float8_e4m3fn, fp8_scores=True)
    assert got == PORTABLE_FP8_TILES


def _without_the_form(monkeypatch) -> None:
    """Importing ``mla_decode_wide_fp8`` fails, as on a Triton without a Gluon operation it imports."""
    import portattn.kernels.triton as package

    monkeypatch.delattr(package, "mla_decode_wide_fp8", raising=False)
    monkeypatch.setitem(sys.modules, "portattn.kernels.triton.mla_decode_wide_fp8", None)


# where the form cannot run: as this machine is; a GPU of compute capability 8.9 (the rules take the GPU's tiles,
# the wide kernel's check says what it needs); a Hopper GPU whose Triton lacks a Gluon operation the form imports
WHERE = {
    "here": (None, None),
    "not_hopper": ("compute capability 9.x (the warpgroup MMA)", "(8, 9)"),
    "no_import": ("a Triton with Gluon's NVIDIA operations", "import of portattn.kernels.triton.mla_decode_wide_fp8"),
}


@pytest.mark.parametrize("where", list(WHERE))
def test_the_default_tiles_fall_back_to_the_portable_kernel_where_the_form_cannot_run(where, monkeypatch):
    """40 heads of float16 queries over an e4m3 cache (a small latent, which the Gluon kernels do not take): the
    default tiles run the portable kernel, at 1 and 2 splits, within the float16 tolerance of the float64
    reference of the dequantized cache, the LSE within 1e-4 of its largest; the fp8-scores tiles asked for
    explicitly name what is missing."""
    if where != "here":
        pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
        from portattn.kernels.triton import mla_decode_wide

        monkeypatch.setattr(launch, "is_triton_interpreter", lambda: False)  # the rules take the GPU's tiles
        lacks = (WHERE[where][0], (8, 9)) if where == "not_hopper" else None
        monkeypatch.setattr(mla_decode_wide, "supports", lambda *args: lacks)
        if where == "no_import":
            _without_the_form(monkeypatch)
    chosen, launched = [], []
    real_choose, real_fitting = launch.choose_tiles, launch.launch_fitting

    def choose(*args, **kwargs):
        chosen.append(real_choose(*args, **kwargs))
        return chosen[-1]

    def fitting(run, tiles, shrink, key):
        launched.append(tiles)
        return real_fitting(run, tiles, shrink, key)

    monkeypatch.setattr(launch, "choose_tiles", choose)
    monkeypatch.setattr(launch, "launch_fitting", fitting)

    heads, page_size, kv_scale, scale = 40, 16, 0.5, 0.2
    lens = [1, 15, 16, 17, 70, 0]
    case = make_mla_case(lens, page_size=page_size, num_heads=heads, dtype=torch.float16, seed=40)
    kv = quantize_kv(case.kv_cache, torch.float8_e4m3fn, kv_scale)
    exact = dequantize_kv(kv, kv_scale, torch.float64)
    inputs = {**case.inputs(), "kv_cache": kv}
    ref, ref_lse = mla_decode_ref(**{**inputs, "kv_cache": exact}, scale=scale, return_lse=True)
    lowp = mla_decode_ref(**{**inputs, "kv_cache": exact.to(torch.float16)}, scale=scale, upcast=False)
    tol = tolerance(ref, lowp, torch.float16)
    args = [inputs[k] for k in ("q_nope", "q_rope", "kv_cache", "page_table", "seq_lens")]
    interpreted = where == "here" and is_triton_interpreter()
    for splits in (1, 2):
        plan = plan_mla_decode(case.page_table, case.seq_lens, page_size, num_heads=heads, kv_lora_rank=RANK,
                               num_kv_splits=splits)  # fmt: skip
        out = torch.full_like(case.q_nope, float("nan"))
        lse = torch.full((len(lens), heads), float("nan"), device=out.device)
        chosen.clear()
        mla_decode_forward(*args, out, scale=scale, num_kv_splits=splits, workspace=plan.workspace, lse=lse,
                           kv_scale=kv_scale)  # fmt: skip
        if interpreted:  # the rules' interpreter tiles: the form is never chosen
            assert chosen == [INTERPRETER_TILES] and launched[-1] == INTERPRETER_TILES
        else:  # chosen, then replaced by the portable kernel's tiles
            # six sequences of one 64-head block: float16 values (fewer than WIDE_FP8_VALUES_MIN_BLOCKS)
            assert chosen == [WIDE_FP8_SCORES_TILES, PORTABLE_FP8_TILES] and launched[-1] == PORTABLE_FP8_TILES
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), splits
        assert max_error(out, ref) <= tol, (splits, max_error(out, ref), tol)
        assert max_error(lse[finite], ref_lse[finite]) <= 1e-4 * float(ref_lse[finite].abs().max()), splits
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # no keys: zeros
    launched.clear()
    if interpreted:
        lacking = [("a GPU without TRITON_INTERPRET (Gluon kernels are not interpreted)", "TRITON_INTERPRET=1")]
    elif where == "here":  # a GPU: not Hopper, or Hopper with this small latent, or a Triton without Gluon
        lacking = [("compute capability 9.x (the warpgroup MMA)", ""), ("a latent of 512 + 64", "32 + 16"),
                   ("a Triton with Gluon's NVIDIA operations", "")]  # fmt: skip
    else:
        lacking = [WHERE[where]]
    form = " for MLATileConfig(fp8_scores=True) (tiles without it run anywhere), got "
    message = "|".join(re.escape(f"expected {needs}{form}{got}") for needs, got in lacking)
    with pytest.raises(ValueError, match=message):
        mla_decode_forward(*args, torch.empty_like(case.q_nope), scale=scale, num_kv_splits=1,
                           tiles=WIDE_FP8_SCORES_TILES, kv_scale=kv_scale)  # fmt: skip
    assert launched == []
