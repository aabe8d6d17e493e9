"""fp8 KV caches in the ops: every backend against the float64 reference computed from the dequantised
cache, with the same tolerance as a cache in the query's dtype (the kernel must compute exactly the
attention of the values it stores), and the refusals.

Fixtures are the ops' own (pages in random order, NaN in every slot no sequence owns, a NaN page in
each row's unused tail), quantised with ``quantize_kv``: NaN stays NaN in fp8. Triton's CPU interpreter
converts fp8 loads (checked here: ``test_triton_interpreter_reads_fp8``), so the kernels' fp8 paths run
on the CPU too; there it decodes the NaN bit patterns as large finite numbers, which still make a
stray read fail the comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import portattn
from conftest import BACKENDS, DEVICE, assert_close_to_reference, backend_dtype_params
from portattn import UnsupportedFeatureError
from portattn.backends import registry
from portattn.backends.torch_ref import TorchBackend
from portattn.device import is_triton_interpreter
from portattn.kv_quant import dequantize_kv, quantize_kv
from portattn.testing import make_paged_case, max_error, mla_decode_ref, paged_attention_ref, tolerance

from .test_mla import make_mla_case

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Page sizes 1, odd and 16, each with one fp8 format (both formats run through every kernel path).
PAGE_KV = [(1, "e4m3"), (7, "e5m2"), (16, "e4m3")]


def params(op: str, interpreted: torch.dtype) -> list:
    """(backend, dtype) pairs; under Triton's slow CPU interpreter, one query dtype per test."""
    pairs = backend_dtype_params(op)
    if not is_triton_interpreter():
        return pairs
    return [p for p in pairs if p.values[0] != "triton" or p.values[1] == interpreted]


K_SCALE, V_SCALE = 0.25, 0.0625  # stored K is 4x the key, stored V 16x the value: both far from 1


def mixed_batch(page_size: int) -> tuple[list[int], list[int]]:
    """Decodes at lengths 1, P-1, P, P+1; an extend over several pages; a prefill."""
    p = page_size
    return [1, 1, 1, 1, 5, p + 2], [1, max(p - 1, 1), p, p + 1, 3 * p + 4, p + 2]


def fp8_case(q_lens, k_lens, *, kv_dtype, q_dtype, page_size, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs):
    """The ops' poisoned fixture with its caches stored in ``kv_dtype`` at the given scales."""
    case = make_paged_case(q_lens, k_lens, page_size=page_size, dtype=torch.float32, device=DEVICE, **kwargs)
    return dataclasses.replace(
        case,
        q=case.q.to(q_dtype),
        k_cache=quantize_kv(case.k_cache, kv_dtype, k_scale),
        v_cache=quantize_kv(case.v_cache, kv_dtype, v_scale),
    )


def check_fp8_paged(case, backend, dtype, *, k_scale=K_SCALE, v_scale=V_SCALE, **kwargs):
    """The op on the fp8 cache against the reference on the dequantised cache (float64 and in ``dtype``)."""
    out = portattn.paged_attention(**case.inputs(), k_scale=k_scale, v_scale=v_scale, backend=backend, **kwargs)
    dequantised = {
        **case.inputs(),
        "k_cache": dequantize_kv(case.k_cache, k_scale, torch.float64),
        "v_cache": dequantize_kv(case.v_cache, v_scale, torch.float64),
    }
    ref = paged_attention_ref(**dequantised, **kwargs)
    lowp = paged_attention_ref(**{**dequantised, "q": case.q}, upcast=False, **kwargs)
    assert_close_to_reference(out, ref, lowp, dtype)
    return out


FEATURES = {
    "causal": {},
    "window": {"window_left": 4},
    "sinks_softcap": {"sinks": "sinks", "logit_softcap": 5.0},
    "chunk_alibi": {"attention_chunk_size": 8, "alibi_slopes": "slopes"},
    "non_causal": {"causal": False},
}


def _feature_kwargs(name: str, dtype: torch.dtype) -> dict:
    kwargs = dict(FEATURES[name])
    if kwargs.get("sinks") == "sinks":
        kwargs["sinks"] = torch.tensor([-2.0, 0.5, 1.5, 4.0], device=DEVICE).to(dtype)
    if kwargs.get("alibi_slopes") == "slopes":
        kwargs["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    return kwargs


@pytest.mark.parametrize(("page_size", "kv"), PAGE_KV)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize(("backend", "dtype"), params("paged_attention", torch.float16))
def test_paged_fp8_against_the_dequantised_reference(backend, dtype, feature, page_size, kv):
    if not registry.backend_class(backend).capabilities.supports("kv_dtype", FP8[kv]):
        pytest.skip(f"{backend} declares no fp8 caches")
    q_lens, k_lens = mixed_batch(page_size)
    case = fp8_case(q_lens, k_lens, kv_dtype=FP8[kv], q_dtype=dtype, page_size=page_size, seed=page_size)
    check_fp8_paged(case, backend, dtype, **_feature_kwargs(feature, dtype))


@pytest.mark.parametrize(("page_size", "kv"), [(3, "e4m3"), (16, "e5m2")])
@pytest.mark.parametrize("feature", ["causal", "sinks_softcap"])
@pytest.mark.parametrize(("backend", "dtype"), params("paged_attention", torch.float16))
def test_paged_fp8_over_a_v_cache_with_its_keys_contiguous(backend, dtype, feature, page_size, kv):
    """The layout the engine's pool gives fp8 V caches (``[N, Hkv, Dv, P]`` in memory, the same logical
    tensor): every backend reads it as the usual one."""
    from portattn.runtime.kv_cache import keys_contiguous

    if not registry.backend_class(backend).capabilities.supports("kv_dtype", FP8[kv]):
        pytest.skip(f"{backend} declares no fp8 caches")
    q_lens, k_lens = mixed_batch(page_size)
    case = fp8_case(q_lens, k_lens, kv_dtype=FP8[kv], q_dtype=dtype, page_size=page_size, seed=page_size + 1)
    v_keys = keys_contiguous(case.v_cache)
    assert v_keys.stride(1) == 1
    out = check_fp8_paged(dataclasses.replace(case, v_cache=v_keys), backend, dtype, **_feature_kwargs(feature, dtype))
    usual = portattn.paged_attention(
        **case.inputs(), k_scale=K_SCALE, v_scale=V_SCALE, backend=backend, **_feature_kwargs(feature, dtype)
    )
    if backend != "triton" or is_triton_interpreter():  # a GPU's decode tiles differ by layout (summation order)
        assert torch.equal(out, usual)


@pytest.mark.parametrize(("head_dim", "value_dim"), [(64, 64), (80, 80), (96, 32), (128, 128), (40, 40), (72, 72)])
@pytest.mark.parametrize(("backend", "dtype"), params("paged_attention", torch.float32))
def test_paged_fp8_head_dims_and_gqa(backend, dtype, head_dim, value_dim):
    caps = registry.backend_class(backend).capabilities
    if not caps.supports("kv_dtype", torch.float8_e4m3fn):
        pytest.skip(f"{backend} declares no fp8 caches")
    if not (caps.supports("head_dim", head_dim) and caps.supports("head_dim", value_dim)):
        pytest.skip(f"{backend} does not declare head dim {head_dim} / {value_dim}")
    q_lens, k_lens = mixed_batch(3)
    case = fp8_case(
        q_lens,
        k_lens,
        kv_dtype=torch.float8_e4m3fn,
        q_dtype=dtype,
        page_size=3,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        value_dim=value_dim,
        seed=head_dim,
    )
    check_fp8_paged(case, backend, dtype)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton does not run here")
@pytest.mark.parametrize(("kv", "num_kv_splits"), [("e4m3", 1), ("e4m3", 5), ("e5m2", 3)])
def test_triton_fp8_split_kv_and_merge(kv, num_kv_splits):
    """Long decodes split over key ranges: every split's output carries the V scale before the merge."""
    from portattn.backends.base import AttentionParams
    from portattn.backends.triton import TritonBackend

    dtype = torch.float16
    case = fp8_case([1, 1, 1], [70, 33, 1], kv_dtype=FP8[kv], q_dtype=dtype, page_size=7, seed=num_kv_splits)
    backend = TritonBackend()
    metadata = backend.plan_paged(case.cu_seqlens_q, case.seq_lens_k, case.page_table, 7, num_kv_splits=num_kv_splits)
    params = AttentionParams(scale=0.125, k_scale=K_SCALE, v_scale=V_SCALE, sinks=torch.zeros(4, device=DEVICE))
    out = torch.empty(3, 4, 64, dtype=dtype, device=DEVICE)
    lse = torch.empty(3, 4, dtype=torch.float32, device=DEVICE)
    backend.paged_attention(case.q, case.k_cache, case.v_cache, metadata, params, out, lse=lse)
    dequantised = {
        **case.inputs(),
        "k_cache": dequantize_kv(case.k_cache, K_SCALE, torch.float64),
        "v_cache": dequantize_kv(case.v_cache, V_SCALE, torch.float64),
    }
    ref, ref_lse = paged_attention_ref(**dequantised, scale=0.125, sinks=params.sinks, return_lse=True)
    lowp = paged_attention_ref(**dequantised, scale=0.125, sinks=params.sinks, upcast=False)
    assert max_error(out, ref) <= tolerance(ref, lowp, dtype)
    assert max_error(lse, ref_lse) <= 1e-5 * float(ref_lse.abs().max())


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton does not run here")
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
@pytest.mark.parametrize("q_range", [1.0, 1e5])
def test_triton_bfloat16_queries_over_fp8_dot_in_float16(kv, q_range):
    """bfloat16 queries over an fp8 cache: the kernels convert K/V to float16 (one instruction per two
    values on the GPU) and the queries, scaled by about the softmax scale, too (``launch.f16_dots_for``).
    Queries past float16's range (1e5) stay finite once scaled. Under the CPU interpreter this is the
    one bfloat16 path that runs (its bfloat16 dots are wrong; these are float16)."""
    dtype = torch.bfloat16
    q_lens, k_lens = mixed_batch(7)
    case = fp8_case(q_lens, k_lens, kv_dtype=FP8[kv], q_dtype=torch.float32, page_size=7, seed=11)
    case = dataclasses.replace(case, q=(case.q * q_range).to(dtype))
    check_fp8_paged(case, "triton", dtype, window_left=9, logit_softcap=5.0 if q_range == 1.0 else 0.0)

    mla = make_mla_case([1, 6, 8, 40], page_size=7, num_heads=5, seed=4)
    kv_scale = 0.0625
    kv_cache = quantize_kv(mla.kv_cache, FP8[kv], kv_scale)
    inputs = {**mla.inputs(), "kv_cache": kv_cache, "q_nope": (mla.q_nope * q_range).to(dtype)}
    inputs["q_rope"] = (mla.q_rope * q_range).to(dtype)
    dequantised = {**inputs, "kv_cache": dequantize_kv(kv_cache, kv_scale, torch.float64)}
    ref = mla_decode_ref(**dequantised, scale=0.125)
    lowp = mla_decode_ref(**dequantised, scale=0.125, upcast=False)
    out = portattn.mla_decode(**inputs, scale=0.125, kv_scale=kv_scale, backend="triton", num_kv_splits=2)
    assert_close_to_reference(out, ref, lowp, dtype)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton does not run here")
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_triton_float16_dots_keep_the_scores_of_bfloat16_queries(kv):
    """bfloat16 queries over fp8 with a softmax scale that is no power of two (0.07): the queries go to float16
    times the power of two below it (exact) and the rest of the scale into the scores', so the LSE of one-key and
    longer sequences stays within 1e-5 of float64. Times 0.07 itself, each query was rounded to float16 and the
    LSE moved by up to 1.1e-3 (MLA at 40 heads on an H200; 7e-4 allowed there)."""
    from portattn.kernels.triton.launch import f16_query_scale

    scales = (0.07, 0.125, 0.0884, 1.0, 3.0, 0.0, -0.5, float("inf"))
    assert [f16_query_scale(s) for s in scales] == [0.0625, 0.125, 0.0625, 1.0, 2.0, 1.0, 1.0, 1.0]
    scale, dtype = 0.07, torch.bfloat16
    q_lens, k_lens = [1, 1, 1, 3], [1, 9, 40, 12]
    case = fp8_case(q_lens, k_lens, kv_dtype=FP8[kv], q_dtype=dtype, page_size=7, seed=5)
    out, lse = portattn.paged_attention(**case.inputs(), scale=scale, k_scale=K_SCALE, v_scale=V_SCALE,
                                        backend="triton", return_lse=True)  # fmt: skip
    dequantised = {
        **case.inputs(),
        "k_cache": dequantize_kv(case.k_cache, K_SCALE, torch.float64),
        "v_cache": dequantize_kv(case.v_cache, V_SCALE, torch.float64),
    }
    ref, ref_lse = paged_attention_ref(**dequantised, scale=scale, return_lse=True)
    lowp = paged_attention_ref(**dequantised, scale=scale, upcast=False)
    assert_close_to_reference(out, ref, lowp, dtype)
    assert max_error(lse, ref_lse) <= 1e-5 * float(ref_lse.abs().max())

    mla = make_mla_case([1, 1, 6, 40], page_size=7, num_heads=20, seed=4)
    kv_cache = quantize_kv(mla.kv_cache, FP8[kv], 0.0625)
    inputs = {**mla.inputs(), "kv_cache": kv_cache, "q_nope": mla.q_nope.to(dtype), "q_rope": mla.q_rope.to(dtype)}
    dequantised = {**inputs, "kv_cache": dequantize_kv(kv_cache, 0.0625, torch.float64)}
    ref, ref_lse = mla_decode_ref(**dequantised, scale=scale, return_lse=True)
    lowp = mla_decode_ref(**dequantised, scale=scale, upcast=False)
    for num_kv_splits in (1, 2):
        out, lse = portattn.mla_decode(**inputs, scale=scale, kv_scale=0.0625, backend="triton",
                                       num_kv_splits=num_kv_splits, return_lse=True)  # fmt: skip
        assert_close_to_reference(out, ref, lowp, dtype)
        assert max_error(lse, ref_lse) <= 1e-5 * float(ref_lse.abs().max()), f"{num_kv_splits} splits"


@pytest.mark.parametrize(("page_size", "kv"), [(1, "e5m2"), (5, "e4m3"), (16, "e5m2")])
@pytest.mark.parametrize(("backend", "dtype"), params("mla_decode", torch.float16))
def test_mla_decode_fp8_against_the_dequantised_reference(backend, dtype, page_size, kv):
    if not registry.backend_class(backend).capabilities.supports("kv_dtype", FP8[kv]):
        pytest.skip(f"{backend} declares no fp8 caches")
    scale, kv_scale = 0.125, 0.0625
    case = make_mla_case([1, page_size - 1 or 1, page_size + 1, 40, 0], page_size=page_size, num_heads=5, seed=2)
    kv_cache = quantize_kv(case.kv_cache, FP8[kv], kv_scale)
    inputs = {**case.inputs(), "kv_cache": kv_cache, "q_nope": case.q_nope.to(dtype), "q_rope": case.q_rope.to(dtype)}
    dequantised = {**inputs, "kv_cache": dequantize_kv(kv_cache, kv_scale, torch.float64)}
    ref, ref_lse = mla_decode_ref(**dequantised, scale=scale, return_lse=True)
    lowp = mla_decode_ref(**dequantised, scale=scale, upcast=False)
    for num_kv_splits in (1, 3):
        out, lse = portattn.mla_decode(
            **inputs, scale=scale, kv_scale=kv_scale, backend=backend, num_kv_splits=num_kv_splits, return_lse=True
        )
        err, tol = max_error(out, ref), tolerance(ref, lowp, dtype)
        assert err <= tol, f"{num_kv_splits} splits: max error {err:.3e} > tolerance {tol:.3e}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert max_error(lse[finite], ref_lse[finite]) <= 1e-5 * float(ref_lse[finite].abs().max())


def test_quantize_saturates_and_keeps_nan():
    for dtype, limit in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        x = torch.tensor([0.0, 1.0, -3.5, 2 * limit, -1e30, float("inf"), float("nan")])
        stored = quantize_kv(x, dtype, 1.0).float()
        assert stored[:3].tolist() == [0.0, 1.0, -3.5]  # representable: exact
        assert stored[3:6].tolist() == [limit, -limit, limit]  # saturated, not NaN or inf
        assert torch.isnan(stored[6])
        # The scale divides on write and multiplies on read.
        assert dequantize_kv(quantize_kv(torch.tensor([3.0, -0.75]), dtype, 0.25), 0.25).tolist() == [3.0, -0.75]
        assert quantize_kv(torch.tensor([1024.0]), dtype, 0.25).float().item() == min(4096.0, limit)
    x = torch.randn(1000, dtype=torch.float64)
    assert torch.equal(quantize_kv(x, torch.float8_e4m3fn, 0.5), (x / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"scale 1\.0 for a torch\.float16 cache"):
        quantize_kv(x, torch.float16, 0.5)


def test_triton_interpreter_reads_fp8():
    """``tl.load`` of fp8 pointers and ``.to(...)`` convert every finite fp8 value exactly (on a GPU, and
    under the interpreter but for two quirks: it reads NaN/inf encodings as large finite numbers, and
    rounds e5m2's subnormals, below 2^-14, when converting to float16)."""
    if "triton" not in BACKENDS:
        pytest.skip("triton does not run here")
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < N - 8, other=0.0).to(Y.dtype.element_ty))

    for dtype in FP8.values():
        x = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(dtype)
        finite = torch.isfinite(x.float())
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
            y = torch.empty(256, dtype=out_dtype, device=DEVICE)
            copy_kernel[(1,)](x, y, N=256)
            want = torch.where(torch.arange(256, device=DEVICE) < 248, x.float(), 0.0).to(out_dtype)
            exact = finite
            if is_triton_interpreter() and (dtype, out_dtype) == (torch.float8_e5m2, torch.float16):
                exact = finite & (x.float().abs() >= 2**-14)
            assert torch.equal(y[exact], want[exact]), (dtype, out_dtype)


class NoFp8Backend(TorchBackend):
    """The torch backend without fp8 in its capabilities: the refusals must name the ones that have it."""

    name = "no_fp8"
    capabilities = dataclasses.replace(TorchBackend.capabilities, kv_dtypes=frozenset())


@pytest.fixture
def no_fp8(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "no_fp8", registry._Entry("no_fp8", f"{__name__}:NoFp8Backend"))
    yield "no_fp8"
    registry._CLASSES.pop("no_fp8", None)
    registry._INSTANCES.pop("no_fp8", None)


def test_a_backend_without_fp8_refuses_it(no_fp8):
    case = fp8_case([1], [5], kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float32, page_size=4)
    with pytest.raises(UnsupportedFeatureError, match=r"'no_fp8' does not support a KV cache of dtype .*float8_e4m3fn"):
        portattn.paged_attention(**case.inputs(), backend=no_fp8)
    try:
        portattn.paged_attention(**case.inputs(), backend=no_fp8)
    except UnsupportedFeatureError as err:
        assert "torch" in err.supported_by and "no_fp8" not in err.supported_by
    mla = make_mla_case([3], page_size=2, num_heads=2)
    kv = quantize_kv(mla.kv_cache, torch.float8_e5m2)
    with pytest.raises(UnsupportedFeatureError, match="float8_e5m2"):
        portattn.mla_decode(**{**mla.inputs(), "kv_cache": kv}, scale=0.1, backend=no_fp8)


def test_fp8_input_errors():
    case = fp8_case([1], [5], kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float32, page_size=4)
    inputs = case.inputs()
    with pytest.raises(ValueError, match="expected v_cache of dtype float8_e4m3fn"):
        portattn.paged_attention(**{**inputs, "v_cache": case.v_cache.float()})
    with pytest.raises(ValueError, match="expected v_cache of dtype float8_e4m3fn"):
        portattn.paged_attention(**{**inputs, "v_cache": case.v_cache.view(torch.uint8).view(torch.float8_e5m2)})
    with pytest.raises(ValueError, match=r"expected k_scale to be a positive finite float, got -1\.0"):
        portattn.paged_attention(**inputs, k_scale=-1.0)
    with pytest.raises(ValueError, match="expected v_scale to be a positive finite float"):
        portattn.paged_attention(**inputs, v_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="expected q of dtype"):
        portattn.paged_attention(**{**inputs, "q": case.q.to(torch.float8_e4m3fn)})
    plain = make_paged_case([1], [5], page_size=4, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected scales 1.0 with a torch.float32 cache, got \(2.0, 1.0\)"):
        portattn.paged_attention(**plain.inputs(), k_scale=2.0)
    mla = make_mla_case([3], page_size=2, num_heads=2)
    with pytest.raises(ValueError, match=r"expected kv_scale 1\.0 with a torch\.float32 cache"):
        portattn.mla_decode(**mla.inputs(), scale=0.1, kv_scale=0.5)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton does not run here")
def test_triton_refuses_an_fp8_format_the_gpu_cannot_convert(monkeypatch):
    """On a GPU without e4m3 conversions (NVIDIA before sm_89) e4m3 is refused up front, naming torch;
    e5m2 still runs there."""
    import portattn.backends.triton as triton_backend

    monkeypatch.setattr(triton_backend, "triton_fp8_dtypes", lambda device: frozenset({torch.float8_e5m2}))
    case = fp8_case([1], [9], kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float16, page_size=4)
    with pytest.raises(UnsupportedFeatureError, match="'triton' does not support a KV cache of dtype") as err:
        portattn.paged_attention(**case.inputs(), backend="triton")
    assert "torch" in err.value.supported_by and "triton" not in err.value.supported_by
    case = fp8_case([1], [9], kv_dtype=torch.float8_e5m2, q_dtype=torch.float16, page_size=4)
    check_fp8_paged(case, "triton", torch.float16)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # Triton's own notice, from reading its options
def test_the_fp8_dtypes_of_a_gpu_are_what_triton_declares_for_its_architecture():
    from triton.backends.compiler import GPUTarget

    from portattn.device import fp8_dtypes_of_target

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert fp8_dtypes_of_target(GPUTarget("cuda", 80, 32)) == {e5m2}  # A100: no e4m3 conversion
    assert fp8_dtypes_of_target(GPUTarget("cuda", 90, 32)) == {e4m3, e5m2}  # H100 / H200
