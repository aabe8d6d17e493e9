"""gpt-oss through the engine: learned sinks, alternating sliding (8 tokens here) and full layers at
head dim 64, biased attention, YaRN, biased experts with the clamped SwiGLU and softmax-over-top-k
routing; MXFP4 experts dequantized at load time. Equal to transformers' own."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from portattn.engine.llm import LLM
from portattn.models.layers import ClampedSwiGLU, FusedMoE, RMSNorm, dequantize_mxfp4
from portattn.testing import quantize_mxfp4, save_tiny_mxfp4_checkpoint, tiny_config
from tiny_models import checkpoint, hf_model, worst_error_against_transformers

from .family_parity import PROMPTS, TOL, make_llm


def test_sinks_on_every_layer_window_on_every_other(ckpt_root):
    path = checkpoint("gpt_oss", ckpt_root)
    layers = LLM(path, num_pages=8, max_model_len=128).engine.model.attention_specs()
    assert [layer.window_left for layer in layers] == [tiny_config("gpt_oss").sliding_window - 1, -1]
    assert [layer.features for layer in layers] == [frozenset({"window", "sinks"}), frozenset({"sinks"})]
    assert {layer.head_dim for layer in layers} == {64}
    for layer, hf_layer in zip(layers, hf_model(path).model.layers):
        assert torch.equal(layer.sinks.cpu(), hf_layer.self_attn.sinks.detach())


# -- MXFP4 -----------------------------------------------------------------------------------------


@functools.cache
def mxfp4_checkpoint(root: str) -> str:
    return save_tiny_mxfp4_checkpoint(f"{root}/gpt_oss_mxfp4")


def test_mxfp4_checkpoint_is_quantized(ckpt_root):
    path = Path(mxfp4_checkpoint(ckpt_root))
    keys = set(load_file(path / "model.safetensors"))
    assert {"model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.1.mlp.experts.down_proj_scales"} <= keys
    assert not any(key.endswith(("experts.gate_up_proj", "experts.down_proj")) for key in keys)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(ckpt_root):
    path = mxfp4_checkpoint(ckpt_root)
    ours = LLM(path, num_pages=8, max_model_len=128).engine.model.model.layers
    theirs = hf_model(path).model.layers  # transformers dequantizes to float32 as it loads
    for layer, hf_layer in zip(ours, theirs):
        experts, hf_experts = layer.mlp.experts, hf_layer.mlp.experts
        assert torch.equal(experts.gate_up_proj.transpose(1, 2).cpu(), hf_experts.gate_up_proj.detach())  # [E, H, 2I]
        assert torch.equal(experts.down_proj.transpose(1, 2).cpu(), hf_experts.down_proj.detach())  # [E, I, H]
    # and they differ from the unquantized checkpoint's (the quantization is not a no-op)
    plain = LLM(checkpoint("gpt_oss", ckpt_root), num_pages=8, max_model_len=128).engine.model.model.layers
    assert not torch.equal(plain[0].mlp.experts.gate_up_proj, ours[0].mlp.experts.gate_up_proj)


@pytest.mark.parametrize("page_size, prefix, chunked", [(7, True, True), (16, False, False)])
def test_mxfp4_checkpoint_matches_transformers(page_size, prefix, chunked, ckpt_root):
    path = mxfp4_checkpoint(ckpt_root)
    llm = make_llm(path, page_size, prefix, chunked)
    assert worst_error_against_transformers(llm, path, PROMPTS, 12, prompt_logits=True) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_mxfp4_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)  # [E, rows, G, 16]
    scales = torch.randint(118, 136, (3, 5, 4), dtype=torch.uint8, generator=g)  # 2**-9 .. 2**8
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, rows, G * 32]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, G * 32, rows]
    assert ours.dtype == dtype and ours.shape == (3, 5, 128)
    assert torch.equal(ours.transpose(1, 2), theirs)
    # code 0x21 (low nibble 1 = +0.5, high nibble 2 = +1.0) at scale 2**1: elements 0 and 1 are 1.0 and 2.0
    one = dequantize_mxfp4(torch.full((1, 16), 0x21, dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8))
    assert one.shape == (32,) and one[:4].tolist() == [1.0, 2.0, 1.0, 2.0]


def test_quantize_mxfp4_round_trips():
    g = torch.Generator().manual_seed(4)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    exact = grid[torch.randint(0, 8, (3, 64), generator=g)] * torch.tensor([[1.0], [0.25], [-8.0]])  # [3, 64]
    exact[:, 0] = 6.0 * torch.tensor([1.0, 0.25, 8.0])  # each row's largest magnitude sets its scale
    exact[:, 32] = exact[:, 0]
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact)), exact)
    w = torch.randn(5, 96, generator=g)
    back = dequantize_mxfp4(*quantize_mxfp4(w))  # [5, 96]
    step = torch.exp2(torch.ceil(torch.log2(w.view(5, 3, 32).abs().amax(-1) / 6)))  # [5, 3] group scales
    assert ((back - w).view(5, 3, 32).abs() <= step[..., None]).all()  # within one FP4 step (<= 1 x scale)


def test_mxfp4_bad_inputs_raise(tmp_path, ckpt_root):
    blocks, scales = torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"expected MXFP4 blocks of dtype torch\.uint8"):
        dequantize_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError, match="expected MXFP4 blocks"):
        dequantize_mxfp4(blocks[:, :3], scales)
    # A checkpoint with a projection's scales missing, and one with another quantization method.
    src = Path(mxfp4_checkpoint(ckpt_root))
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.mlp\.experts\.down_proj \(shard 'scales'\)"):
        LLM(tmp_path, num_pages=8, max_model_len=128)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"expected unquantized experts or quant_method in \['mxfp4'\], got 'gptq'"):
        LLM(tmp_path, num_pages=8, max_model_len=128)


# -- the experts -----------------------------------------------------------------------------------


def test_clamped_swiglu_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = tiny_config("gpt_oss", swiglu_alpha=1.3, swiglu_limit=1.5)
    experts = GptOssExperts(config)  # transformers before 5.2x ignores the config's two and uses 1.702, 7
    alpha, limit = experts.alpha, experts.limit
    gate_up = 2 * limit * torch.randn(7, 2 * config.intermediate_size, generator=torch.Generator().manual_seed(1))
    assert (gate_up.abs() > limit).float().mean() > 0.3  # the clamps act on many values
    ours = ClampedSwiGLU(alpha, limit)(gate_up)
    assert torch.equal(ours, experts._apply_gate(gate_up))


def test_biased_experts_dense_and_grouped_paths_match_a_loop():
    num_experts, hidden, inter, top_k = 4, 16, 8, 2
    g = torch.Generator().manual_seed(2)
    moe = FusedMoE(num_experts, hidden, inter, bias=True, gate_up_act=ClampedSwiGLU(1.702, 1.0))
    for param in moe.parameters():
        param.data = torch.randn(param.shape, generator=g)
    x = torch.randn(20, hidden, generator=g)
    weights = torch.softmax(torch.randn(20, top_k, generator=g), dim=-1)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(20)])
    want = torch.zeros_like(x)
    for t in range(20):
        for j in range(top_k):
            e = ids[t, j]
            h = moe.gate_up_act(x[t] @ moe.gate_up_proj[e].t() + moe.gate_up_proj_bias[e])
            want[t] += weights[t, j] * (h @ moe.down_proj[e].t() + moe.down_proj_bias[e])
    torch.testing.assert_close(moe.forward_dense(x, weights, ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe.forward_grouped(x, weights, ids), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected expert biases only with weights on the output"):
        FusedMoE(num_experts, hidden, inter, bias=True, weight_on_input=True)


def test_rms_norm_weight_in_float32_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    theirs = GptOssRMSNorm(64, eps=1e-5)  # float32 weight, as transformers keeps gpt-oss's norms
    theirs.weight.data.normal_()
    ours = RMSNorm(64, 1e-5, weight_in_float32=True).bfloat16()
    ours.weight.data.copy_(theirs.weight.data)  # a bfloat16 checkpoint's values
    theirs.weight.data.copy_(ours.weight.data.float())
    assert torch.equal(ours(x), theirs(x))
    plain = RMSNorm(64, 1e-5).bfloat16()  # weight * normed.to(bfloat16): rounds twice
    plain.weight.data.copy_(ours.weight.data)
    assert not torch.equal(plain(x), theirs(x))


def test_the_tiny_checkpoint_drives_the_clamps(ckpt_root):
    """The parity matrix would not see a wrong clamp if no value reached the limit."""
    model = hf_model(checkpoint("gpt_oss", ckpt_root))
    seen = []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        apply_gate = experts._apply_gate
        experts._apply_gate = lambda gate_up, apply_gate=apply_gate: seen.append(gate_up) or apply_gate(gate_up)
    try:
        with torch.no_grad():
            model(torch.tensor([PROMPTS[-1]]))
    finally:
        for layer in model.model.layers:
            del layer.mlp.experts._apply_gate
    gate_up = torch.cat([g.reshape(-1, g.shape[-1]) for g in seen])
    limit = model.model.layers[0].mlp.experts.limit
    assert (gate_up[:, ::2] > limit).float().mean() > 0.05  # gates clamped from above
    assert (gate_up[:, 1::2].abs() > limit).float().mean() > 0.05  # ups clamped on both sides
