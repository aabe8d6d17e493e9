"""Sharded layers without processes: each rank reads only its slices of the checkpoint, the ranks'
shards put together are the checkpoint's tensors, KV heads are replicated when there are fewer
than ranks, and head counts that do not divide fail with the numbers."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors import safe_open

from portattn.distributed.group import TPGroup, attention_heads
from portattn.models import loader
from portattn.models.layers import CheckpointSlice, QKVLinear
from portattn.models.llama import LlamaForCausalLM
from portattn.models.loader import load_state
from portattn.testing import save_tiny_checkpoint, save_tiny_mxfp4_checkpoint
from tiny_models import checkpoint


def fake_group(rank: int, size: int) -> TPGroup:
    """A rank's group for building and loading only (no collective is made)."""
    return TPGroup(rank, size, group=object())


def read_spy(monkeypatch) -> list[torch.Size]:
    shapes = []
    original = CheckpointSlice.read

    def read(self):
        out = original(self)
        shapes.append(out.shape)
        return out

    monkeypatch.setattr(CheckpointSlice, "read", read)
    return shapes


@pytest.mark.parametrize(
    "family", ["llama", "deepseek_v3", "mistral", "gemma2", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe", "phi3"]
)
def test_each_rank_reads_only_its_slices(family, ckpt_root, monkeypatch):
    path = checkpoint(family, ckpt_root)
    config = loader.load_config(path)
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        full = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    replicated = ("norm", "gate.weight", "e_score_correction_bias", "q_a_proj", "kv_a_proj")
    shared = sum(t.numel() for k, t in full.items() if any(r in k for r in replicated))
    sharded = sum(t.numel() for k, t in full.items() if not any(r in k for r in replicated))
    models = []
    for rank in range(2):
        shapes = read_spy(monkeypatch)
        models.append(loader.load_model(path, torch.float32, torch.device("cpu"), config, tp=fake_group(rank, 2)))
        assert sum(s.numel() for s in shapes) == shared + sharded // 2  # half of every sharded tensor
        monkeypatch.undo()
    # The two ranks' shards, put back together, are the checkpoint's tensors.
    layer = [m.model.layers[0] for m in models]
    embed = torch.cat([m.model.embed_tokens.weight for m in models])
    assert torch.equal(embed, full["model.embed_tokens.weight"])
    o_proj = torch.cat([lay.self_attn.o_proj.weight for lay in layer], dim=1)
    assert torch.equal(o_proj, full["model.layers.0.self_attn.o_proj.weight"])
    dense, moe = (
        (1, 0) if family in ("qwen3_moe", "qwen2_moe") else (0, 1)
    )  # a layer with a dense MLP, one with experts
    if family != "mixtral":  # experts on every layer
        mlps = [m.model.layers[dense].mlp for m in models]
        gate_up = [mlp.gate_up_proj.split(mlp.gate_up_proj.weight.t())[0].t() for mlp in mlps]
        if family == "phi3":  # one checkpoint tensor: the gate rows, then the up rows
            fused = full[f"model.layers.{dense}.mlp.gate_up_proj.weight"]
            gate = fused[: fused.shape[0] // 2]
        else:
            gate = full[f"model.layers.{dense}.mlp.gate_proj.weight"]
        assert torch.equal(torch.cat(gate_up), gate)
    if family in ("deepseek_v3", "qwen3_moe", "mixtral", "qwen2_moe"):
        experts = [m.model.layers[moe].mlp.experts for m in models]
        down = torch.cat([e.down_proj[3] for e in experts], dim=1)
        name = "block_sparse_moe.experts.3.w2" if family == "mixtral" else "mlp.experts.3.down_proj"
        assert torch.equal(down, full[f"model.layers.{moe}.{name}.weight"])
    if family == "deepseek_v3":
        kv_b = torch.cat([lay.self_attn.kv_b_proj.weight for lay in layer])
        assert torch.equal(kv_b, full["model.layers.0.self_attn.kv_b_proj.weight"])


class Unsharded(LlamaForCausalLM):
    def __init__(self, config):  # overrides __init__ without tp: the support is not inherited
        super().__init__(config)


def test_a_class_without_sharded_layers_is_refused_naming_it(ckpt_root, monkeypatch):
    monkeypatch.setattr(loader, "model_class", lambda architectures: Unsharded)
    with pytest.raises(ValueError, match="supports tensor parallelism for tensor_parallel_size 2, got Unsharded"):
        loader.load_model(checkpoint("llama", ckpt_root), torch.float32, torch.device("cpu"), tp=fake_group(0, 2))


@pytest.mark.parametrize(
    "quantized, intermediate",
    [(False, 32), (True, 32), (True, 64)],
    ids=["bf16-experts", "mxfp4-down-cuts-groups", "mxfp4-down-whole-groups"],
)
def test_gpt_oss_shards_put_together_are_the_checkpoint(quantized, intermediate, tmp_path, monkeypatch):
    """Sinks by query head, interleaved gate/up rows (and their bias) as one run per rank, down
    columns (MXFP4: sliced before dequantizing where a rank's share is whole groups of 32), the down
    bias on rank 0 alone."""
    save = save_tiny_mxfp4_checkpoint if quantized else functools.partial(save_tiny_checkpoint, "gpt_oss")
    path = save(tmp_path / "ckpt", intermediate_size=intermediate)
    cpu = torch.device("cpu")
    whole = loader.load_model(path, torch.float32, cpu).model.layers
    parts, reads = [], []
    for rank in range(2):
        reads.append(read_spy(monkeypatch))
        parts.append(loader.load_model(path, torch.float32, cpu, tp=fake_group(rank, 2)).model.layers)
        monkeypatch.undo()
    for i, layer in enumerate(whole):
        ranks = [part[i] for part in parts]
        assert torch.equal(torch.cat([r.self_attn.sinks for r in ranks]), layer.self_attn.sinks)
        experts, want = [r.mlp.experts for r in ranks], layer.mlp.experts
        assert torch.equal(torch.cat([e.gate_up_proj for e in experts], dim=1), want.gate_up_proj)
        assert torch.equal(torch.cat([e.gate_up_proj_bias for e in experts], dim=1), want.gate_up_proj_bias)
        assert torch.equal(torch.cat([e.down_proj for e in experts], dim=2), want.down_proj)
        assert torch.equal(experts[0].down_proj_bias, want.down_proj_bias) and not experts[1].down_proj_bias.any()
    if quantized:  # the down projection's blocks [E, H, I / 32, 16]: whole, or this rank's groups
        experts, hidden = whole[0].mlp.experts.num_experts, whole[0].mlp.experts.down_proj.shape[1]
        groups = intermediate // 32 // (2 if intermediate == 64 else 1)
        assert [experts, hidden, groups, 16] in [list(shape) for shape in reads[1]]


def test_fewer_kv_heads_than_ranks_are_replicated():
    heads, kv_heads, head_dim, hidden = 8, 2, 3, 5
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    for rank in range(4):
        qkv = QKVLinear(hidden, heads, kv_heads, head_dim, tp=fake_group(rank, 4))
        load_state(qkv, {"q": q, "k": k, "v": v}, lambda key: ("weight", key), what="qkv")
        got_q, got_k, got_v = qkv.split(qkv.weight.t())
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        assert torch.equal(got_q.t(), q[rank * 2 * head_dim : (rank + 1) * 2 * head_dim])
        kv = rank // 2  # query heads 2r, 2r + 1 are in the group of KV head r // 2
        assert torch.equal(got_k.t(), k[kv * head_dim : (kv + 1) * head_dim])
        assert torch.equal(got_v.t(), v[kv * head_dim : (kv + 1) * head_dim])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (4, 2, 3, r"num_attention_heads divisible by tensor_parallel_size 3, got 4"),
        (6, 3, 2, r"num_key_value_heads divisible by tensor_parallel_size 2, got 3"),
        (12, 4, 6, r"num_key_value_heads dividing tensor_parallel_size 6 .*, got 4"),
    ],
)
def test_head_counts_that_do_not_divide(heads, kv_heads, size, message):
    with pytest.raises(ValueError, match=message):
        attention_heads(heads, kv_heads, fake_group(0, size))


def test_a_checkpoint_tensor_of_the_wrong_full_shape_is_named():
    qkv = QKVLinear(4, 2, 2, 2, tp=fake_group(1, 2))
    state = {"q": torch.randn(4, 4), "k": torch.randn(6, 4), "v": torch.randn(4, 4)}
    with pytest.raises(ValueError, match=r"expected k of shape \[4, 4\], got \[6, 4\]"):
        load_state(qkv, state, lambda key: ("weight", key), what="qkv")


def test_checkpoint_slice_reads_the_narrowed_part(tmp_path):
    from safetensors.torch import save_file

    m, s = torch.arange(24.0).view(4, 6), torch.tensor(3.0)
    save_file({"m": m, "s": s}, str(tmp_path / "x.safetensors"))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        handle = f.get_slice("m")
        part = CheckpointSlice(handle, handle.get_shape()).narrow(1, 2, 3).narrow(0, 1, 2)  # rows 1-2, cols 2-4
        assert part.shape == (2, 3)
        assert torch.equal(part.read(), m[1:3, 2:5])
        dst = torch.zeros(2, 3)
        dst.copy_(part)  # used as a tensor, it reads itself
        assert torch.equal(dst, m[1:3, 2:5])
        assert torch.equal(part.t(), m[1:3, 2:5].t())
        scalar = f.get_slice("s")
        assert torch.equal(CheckpointSlice(scalar, scalar.get_shape()).read(), s)
        with pytest.raises(ValueError, match=r"expected a range within dim 1 of size 6, got \[4, 7\)"):
            CheckpointSlice(handle, handle.get_shape()).narrow(1, 4, 3)
