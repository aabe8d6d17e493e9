"""The small-batch linear with its norm and gated activation fused in (``norm_linear``) against the
layers' torch code with the product in float64 (on the CPU through Triton's interpreter in float16; on
a GPU natively, bfloat16 too)."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS, DEVICE
from portattn.models.layers import RMSNorm
from portattn.models.layers.activation import ACTIVATIONS

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton.fused_launch import (
        NORM_LINEAR_ROWS,
        LinearTiles,
        expert_rows,
        expert_tokens,
        linear_tiles,
        norm_linear,
        norm_linear_rotary,
        rotary_kv_write,
        row_linear,
        row_linear_rotary,
    )

STEPS = LinearTiles(16, 64, 4, 2) if "triton" in BACKENDS else None  # a loop over the features
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type != "cpu" else [])
ULP = {torch.float16: 2**-10, torch.bfloat16: 2**-7}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float) -> None:
    """Within ``ulps`` rounding steps of the dtype of each value, plus 1e-4 of the largest value (the
    products summed in another order by the tensor cores' float32 accumulation: on an H200 one sum of
    200 float16 products came 3e-5 of the largest value past a bound of 1e-5)."""
    assert got.dtype == dtype and got.shape == want.shape
    got, want = got.double(), want.double()
    bound = ulps * ULP[dtype] * want.abs() + 1e-4 * want.abs().max()
    excess = (got - want).abs() - bound
    assert float(excess.max()) <= 0, float(((got - want).abs() / want.abs().max()).max())


def reference(x, residual, norm, weight, bias, act):
    """The unfused layers' values: the norm as ``RMSNorm`` rounds it, the product in float64 rounded to
    the dtype, gate and up rounded, the activation rounded before the product."""
    summed = x if residual is None else x + residual
    h = summed if norm is None else norm.norm(summed)
    y = h.double() @ weight.double().T + (0 if bias is None else bias.double())
    if act is None:
        return y.to(x.dtype), summed
    gate, up = y.to(x.dtype).chunk(2, dim=-1)
    return ACTIVATIONS[act](gate.float()).to(x.dtype) * up, summed


def make(rows, in_features, out_features, dtype, *, mode="dtype", bias=False, act=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    norm = None
    if mode is not None:
        norm = RMSNorm(in_features, 1e-5, unit_offset=mode == "unit_offset", weight_in_float32=mode == "float32")
        norm.weight.copy_(1 + 0.3 * torch.randn(in_features, generator=g))
        norm = norm.to(DEVICE, dtype)
    width = out_features * (2 if act else 1)
    weight = (torch.randn(width, in_features, generator=g) / in_features**0.5).to(DEVICE, dtype)
    b = torch.randn(width, generator=g).to(DEVICE, dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(DEVICE, dtype)
    residual = torch.randn(rows, in_features, generator=g).to(DEVICE, dtype)
    return norm, weight, b, x, residual


def run(x, residual, norm, weight, bias, act, tiles=None, interleaved=False):
    return norm_linear(
        x, weight, bias, norm_weight=None if norm is None else norm.weight, eps=1e-5, residual=residual,
        mode="dtype" if norm is None else norm.mode, act=act, tiles=tiles, interleaved=interleaved,
    )  # fmt: skip


@pytest.mark.parametrize("act", [None, "silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("mode", ["dtype", "unit_offset", "float32", None])
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_linear_equals_the_layers(dtype, rows, mode, act):
    norm, weight, bias, x, residual = make(rows, 200, 40, dtype, mode=mode, bias=rows == 7, act=act, seed=rows)
    cases = [(res, tiles) for res in ((residual, None) if norm is not None else (None,)) for tiles in (None, STEPS)]
    for res, tiles in cases:  # all 200 features at once (the default here), and 64 a step
        y, summed = run(x, res, norm, weight, bias, act, tiles)
        want, want_summed = reference(x, res, norm, weight, bias, act)
        close(y, want, dtype, 1.01 if act is None else 3)
        if res is None:
            assert summed is None
        else:
            assert torch.equal(summed, want_summed)  # the add rounds as a separate add does


@pytest.mark.parametrize("tiles", [None, (16, 16, 1, 1), (32, 128, 4, 3), (64, 32, 8, 4)], ids=str)
@pytest.mark.parametrize("shape", [(3, 1, 16), (5, 72, 100), (2, 576, 96)], ids=str)
def test_norm_linear_tiles_and_ragged_shapes(shape, tiles):
    """Widths and features that are not multiples of the tiles (masked columns and a partial last step)."""
    rows, in_features, out_features = shape
    norm, weight, bias, x, residual = make(rows, in_features, out_features, torch.float16, bias=True, act="silu")
    y, summed = run(x, residual, norm, weight, bias, "silu", tiles and LinearTiles(*tiles))
    want, want_summed = reference(x, residual, norm, weight, bias, "silu")
    close(y, want, torch.float16, 3)
    assert torch.equal(summed, want_summed)


def test_norm_linear_reads_strided_rows_and_leaves_its_inputs():
    norm, weight, _, x, residual = make(4, 64, 32, torch.float16)
    wide = torch.randn(4, 3 * 64).to(DEVICE, torch.float16)
    x, residual = wide[:, :64], wide[:, 128:]  # rows 192 apart
    before = wide.clone()
    y, summed = run(x, residual, norm, weight, None, None)
    want, want_summed = reference(x, residual, norm, weight, None, None)
    close(y, want, torch.float16, 1.01)
    assert torch.equal(summed, want_summed) and torch.equal(wide, before)


def test_norm_linear_rejects_what_it_does_not_compute():
    norm, weight, _, x, residual = make(NORM_LINEAR_ROWS + 1, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        run(x, residual, norm, weight, None, None)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        run(x[:2].float(), residual[:2].float(), None, weight.float(), None, None)
    with pytest.raises(ValueError, match="even number of rows"):
        run(x[:2], residual[:2], norm, weight[:31], None, "silu")
    with pytest.raises(ValueError, match="expected a residual like x"):
        run(x[:2], residual[:3], norm, weight, None, None)
    with pytest.raises(ValueError, match="norm_weight with a residual"):
        run(x[:2], residual[:2], None, weight, None, None)
    assert run(x[:0], residual[:0], norm, weight, None, None)[0].shape == (0, 32)


def run_row(x, residual, norm, weight, bias, act, tiles=None, interleaved=False):
    return row_linear(
        x, weight, bias, norm_weight=None if norm is None else norm.weight, eps=1e-5, residual=residual,
        mode="dtype" if norm is None else norm.mode, act=act, tiles=tiles, interleaved=interleaved,
    )  # fmt: skip


@pytest.mark.parametrize("act", [None, "silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("mode", ["dtype", "unit_offset", "float32", None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_linear_equals_the_layers(dtype, mode, act):
    """One row on the vector units: 37 output columns (a partial last block of 8) over 200 features
    (a partial last step of 64, and all at once with the default tiles), with and without a bias,
    residual and norm; the sum of the residual as a separate add rounds it."""
    for bias in (False, True):
        norm, weight, b, x, residual = make(1, 200, 37, dtype, mode=mode, bias=bias, act=act, seed=3 + bias)
        for res in (residual, None) if norm is not None else (None,):
            for tiles in (None, LinearTiles(8, 64, 4, 1), LinearTiles(4, 128, 2, 1)):
                y, summed = run_row(x, res, norm, weight, b, act, tiles)
                want, want_summed = reference(x, res, norm, weight, b, act)
                close(y, want, dtype, 1.01 if act is None else 3)
                assert (summed is None) if res is None else torch.equal(summed, want_summed)


FP8_LAUNCHES = [("norm_linear", 1), ("norm_linear", 7), ("norm_linear", 16), ("row_linear", 1)]


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("launch, rows", FP8_LAUNCHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_weights_with_their_scales_equal_the_dequantized_layers(dtype, launch, rows, act):
    """``quantization="fp8"``'s weights (float8 e4m3, a float32 scale per row) in the fused launches: the
    values of the layers over the dequantized weight ``weight * scale`` in float64 (the rows are not
    quantized); over 200 features at once and 64 a step, with a norm, residual and bias, the gated
    activation's gate and up rows interleaved or not. A 16-bit weight with scales, or fp8 without, is refused."""
    from portattn.models.layers.fp8_linear import quantize_rows

    norm, weight, bias, x, residual = make(rows, 200, 40, dtype, bias=True, act=act, seed=11 + rows)
    weight = weight * torch.linspace(0.2, 5.0, weight.shape[0], device=DEVICE, dtype=dtype)[:, None]  # scales vary
    q, scale = quantize_rows(weight)
    scale = scale.t().contiguous()  # [1, N], as the layers keep it
    dequantized = q.double() * scale.double().t()
    fused = norm_linear if launch == "norm_linear" else row_linear
    for tiles, interleaved in [(None, False), (STEPS if launch == "norm_linear" else LinearTiles(8, 64, 4, 1), True)]:
        interleaved = interleaved and act is not None
        w, s = (interleave(q.view(torch.uint8)).view(q.dtype), interleave(scale[0])) if interleaved else (q, scale)
        b = interleave(bias) if interleaved else bias
        y, summed = fused(
            x, w, b, norm_weight=norm.weight, eps=1e-5, residual=residual, mode=norm.mode, act=act, tiles=tiles,
            interleaved=interleaved, weight_scale=s.contiguous(),
        )  # fmt: skip
        want, want_summed = reference(x, residual, norm, dequantized, bias, act)
        close(y, want, dtype, 1.01 if act is None else 3)
        assert torch.equal(summed, want_summed)
    with pytest.raises(ValueError, match="expected a weight_scale with an fp8 weight and only then"):
        fused(x, weight, None, weight_scale=scale)
    with pytest.raises(ValueError, match="expected a weight_scale with an fp8 weight and only then"):
        fused(x, q, None)
    with pytest.raises(ValueError, match=f"expected {q.shape[0]} contiguous float32 weight scales"):
        fused(x, q, None, weight_scale=scale[:, :-1])


@pytest.mark.parametrize("act, interleaved", [(None, False), ("silu", False), ("silu", True)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_row_linear_words_equal_its_byte_tiles(monkeypatch, dtype, act, interleaved):
    """``row_linear`` over an e4m3 weight read as int32 words of four values (``ROW_LINEAR_WORDS``; on NVIDIA
    GPUs converted by inline PTX, here byte by byte) against Triton's byte-wise tiles and the float64
    layers over the dequantized weight: 40 output features (a partial last block), 200 features at once
    and 64 a step (a partial last step), with a norm and residual, the gate and up rows in halves or
    alternating. Features that are not a multiple of 4, or a weight whose rows do not start on a 4-byte
    boundary, take the byte-wise tiles with the same values."""
    from portattn.kernels.triton import fused_launch
    from portattn.models.layers.fp8_linear import quantize_rows

    for in_features, offset in [(200, 0), (202, 0), (200, 2)]:
        norm, weight, _, x, residual = make(1, in_features, 40, dtype, act=act, seed=in_features + offset)
        q, scale = quantize_rows(weight)
        want, want_summed = reference(x, residual, norm, q.double() * scale.double(), None, act)
        scale = scale.t().contiguous()
        if interleaved:
            q, scale = interleave(q.view(torch.uint8)).view(q.dtype), interleave(scale[0])[None]
        if offset:  # the same rows, starting 2 bytes into the storage
            q = torch.empty(q.numel() + offset, dtype=torch.uint8, device=DEVICE)[offset:].view(q.dtype).view(
                q.shape).copy_(q)  # fmt: skip
        assert fused_launch._in_words(q) == (in_features % 4 == 0 and offset == 0)
        for tiles in (None, LinearTiles(8, 64, 4, 1)):
            got = {}
            for words in (True, False):
                monkeypatch.setattr(fused_launch, "ROW_LINEAR_WORDS", words)
                got[words], summed = row_linear(
                    x, q, None, norm_weight=norm.weight, eps=1e-5, residual=residual, mode=norm.mode, act=act,
                    tiles=tiles, interleaved=interleaved, weight_scale=scale,
                )  # fmt: skip
                close(got[words], want, dtype, 1.01 if act is None else 3)
                assert torch.equal(summed, want_summed)
            # the same products summed in another order: at most a rounding step of the dtype apart
            assert float((got[True].double() - got[False].double()).abs().max()) <= ULP[dtype] * float(
                want.double().abs().max())  # fmt: skip


def interleave(t: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` rows (or bias features) -> ``g0, u0, g1, u1, ...``."""
    return t.unflatten(0, (2, -1)).transpose(0, 1).flatten(0, 1)


@pytest.mark.parametrize("launch", ["norm_linear", "row_linear"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_interleaved_gate_and_up_rows_give_the_same_values(launch, act):
    """A weight (and bias) whose gate and up rows alternate gives the values of the ``[gate; up]``
    weight: the same products in the same order, only other rows read (37 features: a partial last
    block; 200 inputs: a partial last step of 64)."""
    rows = 3 if launch == "norm_linear" else 1
    fn = run if launch == "norm_linear" else run_row
    norm, weight, bias, x, residual = make(rows, 200, 37, torch.float16, bias=True, act=act, seed=11)
    for tiles in (None, LinearTiles(16 if launch == "norm_linear" else 8, 64, 4, 1)):
        want, want_summed = fn(x, residual, norm, weight, bias, act, tiles)
        got, summed = fn(x, residual, norm, interleave(weight), interleave(bias), act, tiles, interleaved=True)
        assert torch.equal(got, want) and torch.equal(summed, want_summed)
        close(got, reference(x, residual, norm, weight, bias, act)[0], torch.float16, 3)


EXPERT_LAYOUTS = [(None, False), ("silu", False), ("silu", True), ("gelu_pytorch_tanh", True)]


@pytest.mark.parametrize("act, interleaved", EXPERT_LAYOUTS)
def test_expert_rows_equal_each_pairs_expert(act, interleaved):
    """Five routed pairs over four experts (expert 3 twice): each row through its own expert's rows,
    as the layers compute one expert (37 features: a partial last block; 200: a partial last step)."""
    g = torch.Generator().manual_seed(5)
    width = 37 * (2 if act else 1)
    weight = (torch.randn(4, width, 200, generator=g) / 200**0.5).to(DEVICE, torch.float16)
    x = torch.randn(5, 200, generator=g).to(DEVICE, torch.float16)
    ids = torch.tensor([3, 0, 3, 1, 2], device=DEVICE)
    for tiles in (None, LinearTiles(8, 64, 4, 1)):
        got = expert_rows(x, ids, interleave_experts(weight) if interleaved else weight, act=act,
                          interleaved=interleaved, tiles=tiles)  # fmt: skip
        assert got.shape == (5, 37)
        for p, e in enumerate(ids.tolist()):
            want, _ = reference(x[p : p + 1], None, None, weight[e], None, act)
            close(got[p : p + 1], want, torch.float16, 1.01 if act is None else 3)


@pytest.mark.parametrize("top_k, scaled", [(1, True), (3, False), (3, True)])
def test_expert_rows_combine_each_tokens_experts(top_k, scaled):
    """``top_k`` > 1 or a routing weight: each token's pairs weighed and summed in the launch give the
    values of the pairs' rows weighed and summed by torch (each product rounded to float16 as there;
    the float32 sum of up to 3 values may round a step apart); two tokens, expert 3 in both."""
    g = torch.Generator().manual_seed(8 + top_k)
    weight = (torch.randn(4, 37, 200, generator=g) / 200**0.5).to(DEVICE, torch.float16)
    ids = torch.tensor([[3, 0, 2], [1, 3, 0]], device=DEVICE)[:, :top_k].contiguous()
    x = torch.randn(ids.numel(), 200, generator=g).to(DEVICE, torch.float16)
    scale = torch.rand(ids.shape, generator=g).to(DEVICE) if scaled else None
    pairs = expert_rows(x, ids.flatten(), weight).view(*ids.shape, 37)
    want = ((pairs * scale[..., None]).to(torch.float16) if scaled else pairs).sum(1)
    for tiles in (None, LinearTiles(8, 64, 4, 1)):
        got = expert_rows(x, ids.flatten(), weight, top_k=top_k, scale=scale, tiles=tiles)
        assert got.shape == (2, 37) and got.dtype == torch.float16
        close(got, want, torch.float16, 1.01)
    with pytest.raises(ValueError, match=r"a multiple of top_k 4, got 2"):
        expert_rows(x[:2], ids.flatten()[:2], weight, top_k=4)
    with pytest.raises(ValueError, match=r"routing weights \(2, 1\), got \(1, 2\)"):
        expert_rows(x[:2], ids.flatten()[:2], weight, scale=torch.ones(1, 2, device=DEVICE))


@pytest.mark.parametrize("act", [None, "silu"])
def test_expert_rows_scale_their_inputs_as_llama4s_torch_code(act):
    """``scale_input``: each pair's input row times its routing weight (bf16-like float16 weights, and float32
    ones), rounded to float16 before the product, as ``(x * w).to(x.dtype)`` then the plain launch: equal bit
    for bit; the expert ids as before (expert 3 twice)."""
    g = torch.Generator().manual_seed(31)
    width = 37 * (2 if act else 1)
    weight = (torch.randn(4, width, 200, generator=g) / 200**0.5).to(DEVICE, torch.float16)
    x = (3 * torch.randn(5, 200, generator=g)).to(DEVICE, torch.float16)
    ids = torch.tensor([3, 0, 3, 1, 2], device=DEVICE)
    for scale in (torch.rand(5, 1, generator=g).to(DEVICE, torch.float16), torch.rand(5, 1, generator=g).to(DEVICE)):
        want = expert_rows((x * scale).to(torch.float16), ids, weight, act=act)
        got = expert_rows(x, ids, weight, act=act, scale=scale, scale_input=True)
        assert torch.equal(got, want)
    with pytest.raises(
        ValueError, match=r"routing weights \[5, 1\] and top_k 1 to scale the inputs, got top_k 1 and no"
    ):
        expert_rows(x, ids, weight, scale_input=True)


def test_expert_rows_without_ids_take_a_head_a_row():
    """``ids`` None: row ``p`` through expert ``p % E`` (two tokens' 3 heads; the weight a strided slice
    of a larger one, as MLA's value half of ``kv_b_proj``)."""
    g = torch.Generator().manual_seed(12)
    whole = (torch.randn(3, 16 + 37, 200, generator=g) / 200**0.5).to(DEVICE, torch.float16)
    weight = whole[:, 16:]  # [3, 37, 200], heads 53 * 200 apart
    x = torch.randn(6, 200, generator=g).to(DEVICE, torch.float16)
    got = expert_rows(x, None, weight)
    assert got.shape == (6, 37)
    for p in range(6):
        want, _ = reference(x[p : p + 1], None, None, weight[p % 3], None, None)
        close(got[p : p + 1], want, torch.float16, 1.01)
    with pytest.raises(ValueError, match=r"whole tokens' heads, a multiple of 3, got 4"):
        expert_rows(x[:4], None, weight)


def interleave_experts(weight: torch.Tensor) -> torch.Tensor:
    return torch.stack([interleave(w) for w in weight])


def test_expert_rows_rejects_what_it_does_not_compute():
    weight = torch.zeros(4, 32, 64, dtype=torch.float16, device=DEVICE)
    x = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    ids = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected expert weights \[E, N, 64\] of torch.float16"):
        expert_rows(x, ids, weight[:, :, :32])
    with pytest.raises(ValueError, match=r"one expert id per row, \[3\] contiguous, got \(2,\)"):
        expert_rows(x, ids[:2], weight)
    with pytest.raises(ValueError, match=r"\[3\] contiguous, got \(3,\) strides \(2,\)"):
        expert_rows(x, torch.zeros(6, dtype=torch.long, device=DEVICE)[::2], weight)
    assert expert_rows(x[:0], ids[:0], weight).shape == (0, 32)


def test_row_linear_rejects_what_it_does_not_compute():
    norm, weight, _, x, residual = make(2, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="one row"):
        run_row(x, residual, norm, weight, None, None)
    with pytest.raises(ValueError, match="even number of rows"):
        run_row(x[:1], residual[:1], norm, weight[:31], None, "silu")
    with pytest.raises(ValueError, match="expected a residual like x"):
        run_row(x[:1], residual, norm, weight, None, None)


def close_rotated(got, want, unrotated, cos, sin, dtype) -> None:
    """``got`` and ``want`` rotated from projections that may differ as :func:`close` allows: within four
    rounding steps of the products' magnitude ``|u| |cos| + |rotate_half(u)| |sin|`` (the sum of two
    products cancels; a step in ``u`` is a step in them) plus 2e-4 of the largest ``u``."""
    u = unrotated.double()
    half = u.shape[-1] // 2
    swapped = torch.cat([u[..., half:], u[..., :half]], dim=-1)
    scale = u.abs() * cos.double().abs()[:, None] + swapped.abs() * sin.double().abs()[:, None]
    excess = (got.double() - want.double()).abs() - (4 * ULP[dtype] * scale + 2e-4 * u.abs().max())
    assert got.dtype == dtype and float(excess.max()) <= 0, float(excess.max())


def rotary_case(rows, heads, head_dim, dtype, *, bias, mode="dtype", page_size=7, seed=0):
    """A q/k/v projection's inputs, a rotate-half table, NaN-poisoned caches and distinct slots."""
    num_q, num_kv = heads
    width = (num_q + 2 * num_kv) * head_dim
    norm, weight, b, x, residual = make(rows, 96, width, dtype, mode=mode, bias=bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    angles = torch.rand(rows, head_dim // 2, generator=g) * 6.3
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(DEVICE, dtype)
    pages = 2 * rows // page_size + 2
    caches = [torch.full((pages, page_size, num_kv, head_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in "kv"]
    slots = torch.randperm(pages * page_size, generator=g)[:rows].to(DEVICE)
    return norm, weight, b, x, residual, cos, sin, caches, slots


@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (2, 2)], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("rows", [1, 6, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_linear_rotary_equals_the_two_launches(dtype, rows, head_dim, heads):
    """One launch (projection, rotation, cache write) gives the values of ``norm_linear`` then
    ``rotary_kv_write`` (the same products; on a GPU a sum may round a step apart, the dot's columns
    sitting elsewhere in its tile, and the rotation carries that step); cache slots other than the new
    tokens' stay as they were (NaN)."""
    norm, weight, bias, x, residual, cos, sin, caches, slots = rotary_case(
        rows, heads, head_dim, dtype, bias=rows == 6, mode="unit_offset" if rows == 16 else "dtype", seed=rows
    )  # fmt: skip
    num_q, num_kv = heads
    tiles = [None] + ([LinearTiles(32, 128, 4, 1), LinearTiles(16, 32, 4, 2)] if head_dim == 64 else [])
    for tile in tiles:  # the default (all features at once, 16 columns), 32 columns, 32 features a step
        want_caches = [c.clone() for c in caches]
        qkv, want_summed = norm_linear(x, weight, bias, norm_weight=norm.weight, eps=1e-5, residual=residual,
                                       mode=norm.mode, tiles=tile)  # fmt: skip
        q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
        want_q = rotary_kv_write(
            q.view(rows, num_q, head_dim), k.view(rows, num_kv, head_dim), v.view(rows, num_kv, head_dim),
            cos, sin, *want_caches, slots,
        )  # fmt: skip
        got_caches = [c.clone() for c in caches]
        got_q, summed = norm_linear_rotary(
            x, weight, bias, cos, sin, *got_caches, slots, num_q_heads=num_q, num_kv_heads=num_kv,
            norm_weight=norm.weight, eps=1e-5, residual=residual, mode=norm.mode, tiles=tile,
        )  # fmt: skip
        close_rotated(got_q, want_q, q.view(rows, num_q, head_dim), cos, sin, dtype)
        assert torch.equal(summed, want_summed)
        for got, want in zip(got_caches, want_caches):
            assert torch.equal(got.isnan(), want.isnan())  # the same slots written, the rest untouched
        got_k, want_k = (c.flatten(0, 1)[slots] for c in (got_caches[0], want_caches[0]))
        close_rotated(got_k, want_k, k.view(rows, num_kv, head_dim), cos, sin, dtype)
        close(got_caches[1].flatten(0, 1)[slots], want_caches[1].flatten(0, 1)[slots], dtype, 2)
        written = want_caches[0].flatten(0, 1)[slots]
        assert not written.isnan().any() and want_caches[0].isnan().sum() == want_caches[0].numel() - written.numel()


@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_linear_rotary_equals_the_two_launches(dtype, head_dim, heads):
    """One row on the vector units (projection, rotation, cache write) gives the values of
    ``row_linear`` then ``rotary_kv_write``, with and without a bias, at 8 columns a program (the
    default) and 16 (on a GPU a sum may round a step apart: the programs hold other columns, and
    their partials are summed in another order); cache slots other than the new token's stay as they
    were (NaN)."""
    num_q, num_kv = heads
    for bias, tile in ((False, None), (True, LinearTiles(16, 32, 4, 1)), (True, LinearTiles(8, 64, 2, 1))):
        norm, weight, b, x, residual, cos, sin, caches, slots = rotary_case(
            1, heads, head_dim, dtype, bias=bias, mode="unit_offset" if bias else "dtype", seed=head_dim + bias
        )  # fmt: skip
        want_caches = [c.clone() for c in caches]
        qkv, want_summed = row_linear(x, weight, b, norm_weight=norm.weight, eps=1e-5, residual=residual,
                                      mode=norm.mode, tiles=tile)  # fmt: skip
        q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
        want_q = rotary_kv_write(
            q.view(1, num_q, head_dim), k.view(1, num_kv, head_dim), v.view(1, num_kv, head_dim), cos, sin,
            *want_caches, slots,
        )  # fmt: skip
        got_caches = [c.clone() for c in caches]
        got_q, summed = row_linear_rotary(
            x, weight, b, cos, sin, *got_caches, slots, num_q_heads=num_q, num_kv_heads=num_kv,
            norm_weight=norm.weight, eps=1e-5, residual=residual, mode=norm.mode, tiles=tile,
        )  # fmt: skip
        close_rotated(got_q, want_q, q.view(1, num_q, head_dim), cos, sin, dtype)  # sums may round a step apart
        assert torch.equal(summed, want_summed)
        for got, want in zip(got_caches, want_caches):
            assert torch.equal(got.isnan(), want.isnan())  # the same slot written, the rest untouched
        got_k, want_k = (c.flatten(0, 1)[slots] for c in (got_caches[0], want_caches[0]))
        close_rotated(got_k, want_k, k.view(1, num_kv, head_dim), cos, sin, dtype)
        close(got_caches[1].flatten(0, 1)[slots], want_caches[1].flatten(0, 1)[slots], dtype, 2)
    with pytest.raises(ValueError, match="one row"):
        row_linear_rotary(x.expand(2, -1), weight, None, cos.expand(2, -1), sin.expand(2, -1), *caches, slots,
                          num_q_heads=num_q, num_kv_heads=num_kv)  # fmt: skip


def test_norm_linear_rotary_rejects_what_it_does_not_compute():
    norm, weight, _, x, residual, cos, sin, caches, slots = rotary_case(2, (2, 1), 16, torch.float16, bias=False)

    def call(weight=weight, caches=caches, num_q_heads=2):
        return norm_linear_rotary(x, weight, None, cos, sin, *caches, slots, num_q_heads=num_q_heads,
                                  num_kv_heads=1, norm_weight=norm.weight, eps=1e-5, residual=residual)  # fmt: skip

    with pytest.raises(ValueError, match="q/k/v weight of 4 heads"):
        call(weight=weight[:56])
    with pytest.raises(ValueError, match=r"K/V caches of torch\.float16"):
        call(caches=[c.float() for c in caches])
    with pytest.raises(ValueError, match="contiguous K/V caches"):
        call(caches=[caches[0], torch.cat([caches[1]] * 2, dim=-1)[..., ::2]])  # every other element
    with pytest.raises(ValueError, match=r"K/V caches of torch\.float16 and head dim 16"):
        call(caches=[c[..., :8].contiguous() for c in caches])
    with pytest.raises(ValueError, match="q/k/v weight of 5 heads"):
        call(num_q_heads=3)  # 64 rows / 5 heads: no whole head dim


def test_linear_tiles():
    """Up to NORM_LINEAR_SINGLE_K features: plain projections in one step of 16 columns, gated ones 256
    features a step; wider rows 128 features a step, in column blocks that give every unit programs."""
    cpu = torch.device("cpu")  # compute_units: the CPU's cores here
    for out_features, in_features, block_k in [(960, 576, 1024), (16, 8, 16), (3072, 1024, 1024), (40, 200, 256)]:
        assert linear_tiles(out_features, in_features, cpu).block_n == 16
        assert linear_tiles(out_features, in_features, cpu).block_k == block_k
        assert linear_tiles(out_features, in_features, cpu, gated=True).block_k == min(256, block_k)
    for out_features, in_features in [(6144, 4096), (28672, 4096), (16, 2048)]:
        tiles = linear_tiles(out_features, in_features, cpu)
        assert tiles.block_n in (16, 32, 64) and tiles.block_k == 128
        assert tiles.block_n == 16 or -(-out_features // tiles.block_n) >= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_a_plain_linear_over_1536_features_in_one_step(dtype, rows):
    """``models.layers.linear.small_linear``'s launch (the MLP's down projection, ``SMALL_DOWN_PROJ``):
    no norm, every feature of a 1536-wide row in one step of 2048 (masked), 4 warps up to
    ``SMALL_LINEAR_FEW_ROWS`` rows and 8 past them, against float64."""
    from portattn.models.layers.linear import SMALL_LINEAR_FEW_ROWS

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1536, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(40, 1536, generator=g) / 1536**0.5).to(DEVICE, dtype)
    bias = torch.randn(40, generator=g).to(DEVICE, dtype)
    warps = 4 if rows <= SMALL_LINEAR_FEW_ROWS else 8
    got, summed = norm_linear(x, weight, bias, tiles=LinearTiles(16, 2048, warps, 1))
    assert summed is None and got.shape == (rows, 40)
    ref = x.double() @ weight.double().T + bias.double()
    assert float((got.double() - ref).abs().max()) <= 4 * ULP[dtype] * float(ref.abs().max())


@pytest.mark.parametrize("act, interleaved", EXPERT_LAYOUTS)
@pytest.mark.parametrize("rows", ["token", "pair"])
@pytest.mark.parametrize("scaled", [None, "input", "output"])
def test_expert_tokens_equal_each_pairs_expert(act, interleaved, rows, scaled, monkeypatch):
    """Twenty tokens, 3 experts each of 6 (expert 5 chosen by none; 3 slots padded to 4), in blocks of
    16 tokens (a second, partial block): every pair's output row through its own expert, the routing
    weight applied to its input or its output as the torch code rounds it (37 features: a partial
    last column block; 200: a partial last step)."""
    import portattn.kernels.triton.fused_launch as launch

    monkeypatch.setattr(launch, "EXPERT_TOKENS_BLOCK", 16)
    g = torch.Generator().manual_seed(7)
    tokens, top_k, experts, dtype = 20, 3, 6, torch.float16
    width = 37 * (2 if act else 1)
    weight = (torch.randn(experts, width, 200, generator=g) / 200**0.5).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    scale = torch.rand(tokens, top_k, generator=g).to(DEVICE) if scaled else None
    x = torch.randn(tokens * (top_k if rows == "pair" else 1), 200, generator=g).to(DEVICE, dtype)
    for tiles in (None, LinearTiles(16, 64, 4, 2)):
        w = interleave_experts(weight) if interleaved else weight
        got = expert_tokens(x, ids, w, act=act, interleaved=interleaved, scale=scale, scale_input=scaled == "input",
                            tiles=tiles)  # fmt: skip
        assert got.shape == (tokens * top_k, 37)
        for t in range(tokens):
            for slot, e in enumerate(ids[t].tolist()):
                pair = t * top_k + slot
                row = x[pair if rows == "pair" else t][None]
                if scaled == "input":  # the float32 weight unrounded, as the layer's [T, k] weights multiply
                    row = (row.float() * scale[t, slot]).to(dtype)
                want, _ = reference(row, None, None, weight[e], None, act)
                if scaled == "output":
                    want = (want.float() * scale[t, slot]).to(dtype)
                close(got[pair][None], want, dtype, 1.01 if act is None and scaled != "output" else 3)


def test_expert_tokens_float32_is_exact_to_float32_rounding():
    """float32 rows take IEEE dots (not TF32): within 1e-5 of the float64 product."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4, 48, 96, generator=g).to(DEVICE)
    ids = torch.tensor([[2, 0], [1, 2], [0, 3]], device=DEVICE)
    x = torch.randn(3, 96, generator=g).to(DEVICE)
    got = expert_tokens(x, ids, weight)
    want = torch.stack([x[t].double() @ weight[e].double().T for t in range(3) for e in ids[t].tolist()])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_expert_tokens_rejects_what_it_does_not_compute():
    weight = torch.zeros(4, 32, 64, dtype=torch.float16, device=DEVICE)
    x = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected rows \[3, 64\] \(a token's\) or \[6, 64\] \(a pair's\)"):
        expert_tokens(x[:2], ids, weight)
    with pytest.raises(ValueError, match=r"expected expert weights \[E, N, 64\] of torch.float16"):
        expert_tokens(x, ids, weight.float())
    with pytest.raises(ValueError, match="expected contiguous top-k ids"):
        expert_tokens(x, torch.zeros(3, 4, dtype=torch.long, device=DEVICE)[:, ::2], weight)
    with pytest.raises(ValueError, match=r"expected contiguous routing weights \(3, 2\), got \(3, 1\)"):
        expert_tokens(x, ids, weight, scale=torch.ones(3, 1, device=DEVICE))
    with pytest.raises(ValueError, match="scale_input needs the routing weights"):
        expert_tokens(x, ids, weight, scale_input=True)
    assert expert_tokens(x[:0], ids[:0], weight).shape == (0, 32)
