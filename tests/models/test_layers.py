"""The shared layers: loading through weight_loader, the MoE's two paths, norms and the sync rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import BACKENDS, DEVICE
from portattn.models.layers import FusedMoE, GatedMLP, MergedLinear, QKVLinear, RMSNorm, WeightShapeError
from portattn.models.layers import moe as moe_module
from portattn.models.layers.moe import DENSE_MAX_TOKENS
from portattn.models.loader import load_state
from portattn.testing import no_host_sync


def test_merged_linear_loads_each_checkpoint_tensor_into_its_rows():
    qkv = QKVLinear(8, num_heads=4, num_kv_heads=2, head_dim=2, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    bq, bk, bv = torch.randn(8), torch.randn(4), torch.randn(4)
    state = {"q.w": q, "k.w": k, "v.w": v, "q.b": bq, "k.b": bk, "v.b": bv}
    names = {"w": "weight", "b": "bias"}
    load_state(qkv, state, lambda key: (names[key[2]], key[0]), what="qkv")
    x = torch.randn(3, 8)
    got = qkv.split(qkv(x))
    for out, w, b in zip(got, (q, k, v), (bq, bk, bv)):
        assert torch.allclose(out, F.linear(x, w, b), rtol=1e-6, atol=1e-6)  # one matmul vs three: rounding


def test_missing_shard_and_wrong_shape_are_named():
    mlp = GatedMLP(8, 16)
    gate, up, down = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    mapping = {"gate": ("gate_up_proj.weight", 0), "up": ("gate_up_proj.weight", 1), "down": ("down_proj.weight", None)}
    with pytest.raises(ValueError, match=r"missing \['gate_up_proj.weight \(shard 1\)'\]"):
        load_state(mlp, {"gate": gate, "down": down}, mapping.get, what="the MLP")
    with pytest.raises(ValueError, match=r"expected up of shape \[16, 8\], got \[15, 8\]"):
        load_state(mlp, {"gate": gate, "up": up[:15], "down": down}, mapping.get, what="the MLP")
    with pytest.raises(ValueError, match="unknown tensor 'extra'"):
        load_state(mlp, {"extra": down}, lambda key: ("nope", None), what="the MLP")
    load_state(mlp, {"gate": gate, "up": up, "down": down}, mapping.get, what="the MLP")
    x = torch.randn(5, 8)
    assert torch.allclose(mlp(x), F.linear(F.silu(x @ gate.t()) * (x @ up.t()), down), atol=1e-6)


def test_the_gated_mlp_keeps_gate_and_up_rows_alternating():
    """Gate row ``j`` at row ``2j``, up row ``j`` at ``2j + 1`` (weight and bias); ``split`` gives the
    two outputs back; the MLP computes ``down(act(gate(x)) * up(x))``."""
    mlp = GatedMLP(8, 6, "gelu_pytorch_tanh", bias=True)
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    bg, bu, bd = torch.randn(6), torch.randn(6), torch.randn(8)
    state = {"gate.weight": gate, "up.weight": up, "down.weight": down, "gate.bias": bg, "up.bias": bu, "down.bias": bd}
    shards = {"gate": 0, "up": 1}

    def mapping(key):
        part, param = key.split(".")
        return (f"down_proj.{param}", None) if part == "down" else (f"gate_up_proj.{param}", shards[part])

    load_state(mlp, state, mapping, what="the MLP")
    assert mlp.gate_up_proj.interleaved
    assert torch.equal(mlp.gate_up_proj.weight[0::2], gate) and torch.equal(mlp.gate_up_proj.weight[1::2], up)
    assert torch.equal(mlp.gate_up_proj.bias[0::2], bg) and torch.equal(mlp.gate_up_proj.bias[1::2], bu)
    x = torch.randn(5, 8, dtype=torch.float64)
    mlp.double()
    g, u = mlp.gate_up_proj.split(mlp.gate_up_proj(x))
    assert torch.allclose(g, F.linear(x, gate.double(), bg.double()))
    assert torch.allclose(u, F.linear(x, up.double(), bu.double()))
    want = F.linear(F.gelu(g, approximate="tanh") * u, down.double(), bd.double())
    assert torch.allclose(mlp(x), want)
    with pytest.raises(ValueError, match=r"interleaved shards of one size, got \[2, 3\]"):
        MergedLinear(4, [2, 3], interleaved=True)


def test_merged_linear_refuses_an_unknown_shard():
    layer = MergedLinear(4, [2, 3])
    with pytest.raises(ValueError, match=r"expected a shard in \[0, 1\], got 2"):
        layer.weight.weight_loader(layer.weight, torch.zeros(2, 4), 2)
    with pytest.raises(WeightShapeError):
        layer.weight.weight_loader(layer.weight, torch.zeros(2, 4), 1)


def _moe_reference(moe: FusedMoE, x, weights, ids):
    """Token by token, expert by expert: the sum the layer must compute."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = moe.intermediate_size
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].double(), ids[t].tolist()):
            xin = x[t].double() * (w if moe.weight_on_input else 1.0)
            gate_up = moe.gate_up_proj[e].double() @ xin
            gate, up = (gate_up[0::2], gate_up[1::2]) if moe.gate_up_interleaved else (gate_up[:inter], gate_up[inter:])
            y = moe.down_proj[e].double() @ (F.silu(gate) * up)
            out[t] += y if moe.weight_on_input else w * y
    return out


@pytest.mark.parametrize("interleaved", [False, True])  # moe.EXPERTS_INTERLEAVED
@pytest.mark.parametrize("weight_on_input", [False, True])
@pytest.mark.parametrize("num_tokens", [1, DENSE_MAX_TOKENS, DENSE_MAX_TOKENS + 5])
def test_moe_dense_and_grouped_paths_equal_the_reference(weight_on_input, num_tokens, interleaved, monkeypatch):
    monkeypatch.setattr(moe_module, "EXPERTS_INTERLEAVED", interleaved)
    g = torch.Generator().manual_seed(num_tokens)
    moe = FusedMoE(6, 8, 12, weight_on_input=weight_on_input)
    assert moe.gate_up_interleaved == interleaved
    moe.gate_up_proj.data.copy_(torch.randn(moe.gate_up_proj.shape, generator=g) / 3)
    moe.down_proj.data.copy_(torch.randn(moe.down_proj.shape, generator=g) / 3)
    x = torch.randn(num_tokens, 8, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(num_tokens)])  # distinct per token
    weights = torch.rand(num_tokens, 2, generator=g)
    ref = _moe_reference(moe, x, weights, ids)
    for path in (moe.forward_dense, moe.forward_grouped, moe.forward):
        assert torch.allclose(path(x, weights, ids).double(), ref, atol=1e-5), path.__name__


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("weight_on_input", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 2, 6])
@pytest.mark.parametrize("interleaved, combine", [(False, False), (True, False), (False, True)])
def test_moe_routed_path_equals_the_dense_path(weight_on_input, num_tokens, top_k, interleaved, combine, monkeypatch):
    """The routed path against the dense path and the float64 reference, float16 through the Triton
    interpreter here; one or two experts a token. Up to 2 tokens (fewer pairs than the 6 experts):
    each pair through its expert's rows (two tokens: an expert picked by both), with ``combine``
    (moe.COMBINE_IN_KERNEL) weighed and summed in the down projection's launch, equal to the torch
    combination; 6 tokens: each expert on the tokens that chose it (expert 5 by none with one expert
    a token)."""
    from portattn.kernels.triton import fused_launch

    launched = []
    for name in ("expert_rows", "expert_tokens"):
        fn = getattr(fused_launch, name)
        monkeypatch.setattr(fused_launch, name, lambda *a, _f=fn, _n=name, **kw: launched.append(_n) or _f(*a, **kw))

    monkeypatch.setattr(moe_module, "EXPERTS_INTERLEAVED", interleaved)
    monkeypatch.setattr(moe_module, "COMBINE_IN_KERNEL", combine)
    g = torch.Generator().manual_seed(7 + num_tokens)
    moe = FusedMoE(6, 72, 20, weight_on_input=weight_on_input).to(DEVICE, torch.float16)
    moe.gate_up_proj.data.copy_(torch.randn(moe.gate_up_proj.shape, generator=g) / 6)
    moe.down_proj.data.copy_(torch.randn(moe.down_proj.shape, generator=g) / 3)
    x = torch.randn(num_tokens, 72, generator=g).to(DEVICE, torch.float16)
    ids = torch.tensor([[4, 1], [1, 3], [0, 4], [2, 5], [1, 0], [3, 2]][:num_tokens], device=DEVICE)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g).to(DEVICE)
    got = moe.forward_routed(x, weights, ids, fused_launch)
    assert launched == 2 * ["expert_rows" if num_tokens * top_k < 6 else "expert_tokens"]
    if combine and launched[0] == "expert_rows":
        monkeypatch.setattr(moe_module, "COMBINE_IN_KERNEL", False)
        unfused = moe.forward_routed(x, weights, ids, fused_launch)
        assert torch.allclose(got.float(), unfused.float(), atol=1e-3, rtol=1e-3) and not torch.equal(got, 0 * got)
    dense = moe.forward_dense(x, weights, ids)
    assert got.dtype == torch.float16 and got.shape == (num_tokens, 72)
    assert torch.allclose(got.float(), dense.float(), atol=2e-3, rtol=1e-2)
    ref = _moe_reference(moe.double().cpu(), x.double().cpu(), weights.cpu(), ids.cpu())
    assert torch.allclose(got.double().cpu(), ref, atol=1e-2, rtol=1e-2)


def test_moe_decode_path_and_layers_do_not_sync():
    moe = FusedMoE(4, 8, 12)
    for p in (moe.gate_up_proj, moe.down_proj):
        p.data.normal_()
    x, ids, weights = torch.randn(DENSE_MAX_TOKENS, 8), torch.randint(0, 4, (DENSE_MAX_TOKENS, 1)), torch.rand(16, 1)
    with no_host_sync():
        moe(x, weights, ids)
        RMSNorm(8, 1e-6)(x)
    with pytest.raises(AssertionError, match="host sync"), no_host_sync():
        moe.forward_grouped(x, weights, ids)  # the prefill path's one sync per layer: the guard sees it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_variants(dtype):
    x = torch.randn(4, 8).to(dtype)
    w = torch.randn(8)
    plain, gemma = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6, unit_offset=True)
    plain.weight.data.copy_(w.to(plain.weight.dtype))
    gemma.weight.data.copy_(w.to(gemma.weight.dtype))
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(gemma(x), (normed * (1 + w)).to(dtype))
    assert torch.equal(plain(x), plain.weight * normed.to(dtype))
    assert torch.equal(RMSNorm(8, 1e-6, unit_offset=True).weight, torch.zeros(8))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_lm_head_logits_are_float32_and_not_rounded_to_the_model_dtype(device):
    """bf16 hidden states and weights give float32 logits; where torch has a float32-output matmul
    (CUDA) they are the exact products' sum to float32 accuracy, not rounded to bf16 (which moves a
    logit of ~20 by up to 1/16)."""
    from portattn.models.layers.embedding import LMHead, has_float32_out_mm

    g = torch.Generator().manual_seed(0)
    head = LMHead(64, 300).to(device=device, dtype=torch.bfloat16)
    head.weight.data.copy_(torch.randn(300, 64, generator=g))
    x = (torch.randn(5, 64, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, 300)
    ref = x.double() @ head.weight.double().t()
    rounded = ref.to(torch.bfloat16).double()
    if has_float32_out_mm(x.device, x.dtype):
        assert (logits.double() - ref).abs().max() < 1e-4 * ref.abs().max()
        assert (logits.double() - ref).abs().max() < (rounded - ref).abs().max() / 10
    else:
        assert torch.equal(logits, torch.nn.functional.linear(x, head.weight).float())
