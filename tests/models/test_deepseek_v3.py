"""DeepSeek V3 through the engine: greedy tokens and logits equal transformers' own at page sizes
1, 16 and 64 (and 7 for the variant without q LoRA), with and without prefix caching and chunked
prefill; decode goes through the backend's absorbed ``mla_decode``, planned once per forward."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DeepseekV3Config

import portattn.mla
import portattn.runtime.kv_cache
import portattn.runtime.plan
from backends.test_backend_api import make_batch
from conftest import BACKENDS
from portattn.backends.base import Request
from portattn.backends.registry import select_backend
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.errors import UnsupportedFeatureError
from portattn.models.deepseek_v3 import DeepseekV3ForCausalLM
from portattn.runtime.kv_cache import KVCacheSpec, MLAKVPool, make_kv_pool, mla_cache_spec
from portattn.runtime.plan import plan_latent_attention
from portattn.testing import DEEPSEEK_V3_VARIANTS, save_tiny_checkpoint, tiny_config
from tiny_models import ENGINE_DEVICE, hf_reference, random_prompts, rel_err, worst_error_against_transformers

MAX_NEW = 12
# Lengths 1, short, past one 16-token page, and past one 64-token page.
PROMPTS = random_prompts([1, 6, 19, 41, 70], seed=3)
# Second wave: a repeat and two extensions of first-wave prompts (prefix-cache hits at every page size).
SHARED = [PROMPTS[4], [*PROMPTS[4][:66], 9, 8, 7], [*PROMPTS[3], *range(1, 30)]]
TOL = 1e-4


def config(variant: str, **overrides) -> DeepseekV3Config:
    return tiny_config("deepseek_v3", **(DEEPSEEK_V3_VARIANTS[variant] | overrides))


CONFIG = config("yarn")


@functools.cache
def checkpoint(variant: str, root: str) -> str:
    """The tiny DeepSeek V3 checkpoint of ``variant`` (norms and expert-score biases not at their neutral init)."""
    return save_tiny_checkpoint("deepseek_v3", f"{root}/deepseek_v3_{variant}", **DEEPSEEK_V3_VARIANTS[variant])


def make_llm(path: str, page_size: int, prefix: bool, chunked: bool, **kwargs) -> LLM:
    return LLM(
        path,
        page_size=page_size,
        num_pages=-(-1600 // page_size),
        max_num_seqs=8,
        enable_prefix_caching=prefix,
        chunked_prefill_size=16 if chunked else None,
        device=ENGINE_DEVICE,
        **kwargs,
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked16"])
@pytest.mark.parametrize("prefix", [False, True], ids=["noprefix", "prefix"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_matches_transformers(page_size, prefix, chunked, ckpt_root):
    path = checkpoint("yarn", ckpt_root)
    llm = make_llm(path, page_size, prefix, chunked)
    err = max(
        worst_error_against_transformers(llm, path, PROMPTS, MAX_NEW, prompt_logits=True),
        worst_error_against_transformers(llm, path, SHARED, MAX_NEW, prompt_logits=False),
    )
    print(f"page {page_size} prefix {prefix} chunked {chunked}: tokens equal, max logit rel err {err:.2e}")
    assert err < TOL
    pool = llm.engine.kv_pool
    assert isinstance(pool, MLAKVPool)
    assert pool.kv_cache(0).latent.shape == (pool.num_pages, page_size, CONFIG.kv_lora_rank + CONFIG.qk_rope_head_dim)
    cached = llm.engine.pages.num_cached_tokens
    if prefix:
        assert cached >= page_size * (len(PROMPTS[4]) // page_size)  # the repeated prompt's full pages
    else:
        assert cached == 0
    allocator = llm.engine.allocator
    assert allocator.num_used == len(llm.engine.pages.cache)


def test_without_q_lora_rotate_half_default_rope(ckpt_root):
    path = checkpoint("plain", ckpt_root)
    llm = make_llm(path, page_size=7, prefix=True, chunked=True)
    err = max(
        worst_error_against_transformers(llm, path, PROMPTS, MAX_NEW, prompt_logits=True),
        worst_error_against_transformers(llm, path, SHARED, MAX_NEW, prompt_logits=False),
    )
    assert err < TOL
    assert llm.engine.pages.num_cached_tokens > 0


def test_decode_absorbed_and_planned_once_per_forward(ckpt_root, monkeypatch):
    path = checkpoint("yarn", ckpt_root)
    # eager: a captured decode graph replays the plan it recorded (tests/engine/test_graphs*.py)
    llm = make_llm(path, page_size=5, prefix=False, chunked=True, enforce_eager=True)
    backend = llm.engine.backend
    calls = dict.fromkeys(["steps", "plan", "plan_decode", "plan_varlen", "mla_decode", "varlen"], 0)

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    plan_module = portattn.runtime.plan
    monkeypatch.setattr(llm.engine, "step", count("steps", llm.engine.step))
    kind_module = portattn.runtime.kv_cache  # the "mla" pool makes the plan
    monkeypatch.setattr(kind_module, "plan_latent_attention", count("plan", plan_module.plan_latent_attention))
    monkeypatch.setattr(plan_module, "plan_mla_decode", count("plan_decode", portattn.mla.plan_mla_decode))
    monkeypatch.setattr(backend, "mla_decode", count("mla_decode", backend.mla_decode))
    monkeypatch.setattr(backend, "varlen_attention", count("varlen", backend.varlen_attention))
    monkeypatch.setattr(backend, "plan_varlen", count("plan_varlen", backend.plan_varlen))
    monkeypatch.setattr(portattn.mla, "mla_decode", None)  # the engine must not go through the validating op
    prompts = random_prompts([3, 30], seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_reference(path, tuple(prompt), 8)[0]
    layers = CONFIG.num_hidden_layers
    assert calls["plan"] == calls["steps"]
    # Prompt chunks are expanded, decodes absorbed; some steps (a decode beside a chunk) do both.
    assert 0 < calls["plan_decode"] < calls["steps"] and 0 < calls["plan_varlen"] < calls["steps"]
    assert calls["plan_decode"] + calls["plan_varlen"] > calls["steps"]
    assert calls["mla_decode"] == layers * calls["plan_decode"]
    assert calls["varlen"] == layers * calls["plan_varlen"]


def test_bfloat16_keeps_router_weights_in_float32(ckpt_root):
    path = checkpoint("yarn", ckpt_root)
    llm = LLM(path, dtype="bfloat16", page_size=16, num_pages=64)
    gate = llm.engine.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert llm.engine.model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert llm.engine.kv_pool.kv_cache(0).latent.dtype == torch.bfloat16
    # Greedy tokens of a short prompt agree with transformers' bfloat16 model (routing included).
    prompt = PROMPTS[2]
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    # transformers keeps the router weights in float32 from 5.2x; before, set them from the checkpoint.
    weights = load_file(f"{path}/model.safetensors")
    for i, layer in enumerate(want.model.layers[CONFIG.first_k_dense_replace :], CONFIG.first_k_dense_replace):
        layer.mlp.gate.weight.data = weights[f"model.layers.{i}.mlp.gate.weight"].float()
    want.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = want.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_plan_gathers_every_key_slot_and_plans_decode_on_the_page_table(page_size):
    torch_backend = select_backend("attention", "torch", Request("paged_attention", "cpu", torch.float32, 24))
    q_lens, k_lens = [2, 5, 3], [13, 5, 20]
    batch = make_batch(page_size, q_lens, k_lens, num_pages=-(-64 // page_size))
    metadata = torch_backend.plan(batch)
    plan = plan_latent_attention(torch_backend, metadata, num_heads=4, kv_lora_rank=32)
    rows = batch.req_pool_indices.tolist()
    want = torch.cat([batch.req_to_token[row, :n] for row, n in zip(rows, k_lens)]).long()
    assert plan.decode is None and torch.equal(plan.key_slots, want)
    assert plan.varlen.k_lens == tuple(k_lens) and plan.varlen.q_lens == tuple(q_lens)

    batch = make_batch(page_size, [1, 1, 1], k_lens, num_pages=-(-64 // page_size))
    metadata = torch_backend.plan(batch)
    plan = plan_latent_attention(torch_backend, metadata, num_heads=4, kv_lora_rank=32)
    assert plan.key_slots is None and plan.decode.page_table is metadata.page_table
    assert plan.decode.max_seqlen_k == max(k_lens)

    # Mixed: the decodes (sequences 1, 2) absorbed, sequence 0's chunk expanded; tokens picked by row.
    batch = make_batch(page_size, [3, 1, 1], k_lens, num_pages=-(-64 // page_size))
    metadata = torch_backend.plan(batch)
    plan = plan_latent_attention(torch_backend, metadata, num_heads=4, kv_lora_rank=32)
    assert torch.equal(plan.key_slots, batch.req_to_token[rows[0], : k_lens[0]].long())
    assert plan.varlen.q_lens == (3,) and plan.varlen.k_lens == (k_lens[0],)
    assert torch.equal(plan.decode.page_table, metadata.page_table[1:])
    assert plan.decode.seq_lens_k.tolist() == k_lens[1:] and plan.decode.max_seqlen_k == max(k_lens[1:])
    assert plan.decode_rows.tolist() == [3, 4] and plan.expand_rows.tolist() == [0, 1, 2]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_decodes_of_several_tokens_are_absorbed_one_row_per_token(page_size):
    """With decode_q_len 5 (speculative verification of 4 drafted tokens), sequences of up to 5 new
    tokens are decodes: one absorbed row per new token, seeing the keys up to its own token."""
    torch_backend = select_backend("attention", "torch", Request("paged_attention", "cpu", torch.float32, 24))
    q_lens, k_lens = [2, 5, 3], [13, 5, 20]
    batch = make_batch(page_size, q_lens, k_lens, num_pages=-(-64 // page_size))
    metadata = torch_backend.plan(batch)
    plan = plan_latent_attention(torch_backend, metadata, num_heads=4, kv_lora_rank=32, decode_q_len=5)
    assert plan.varlen is None and plan.decode_rows is None
    owner = [b for b, n in enumerate(q_lens) for _ in range(n)]  # the sequence of each row
    assert torch.equal(plan.decode.page_table, metadata.page_table[owner])
    want = [k - n + 1 + i for n, k in zip(q_lens, k_lens) for i in range(n)]
    assert plan.decode.seq_lens_k.tolist() == want and plan.decode.max_seqlen_k == max(k_lens)

    # decode_q_len 2: sequence 0 absorbed (2 rows), the others expanded; tokens picked by row.
    plan = plan_latent_attention(torch_backend, metadata, num_heads=4, kv_lora_rank=32, decode_q_len=2)
    assert plan.decode.seq_lens_k.tolist() == [12, 13] and torch.equal(
        plan.decode.page_table, metadata.page_table[[0, 0]]
    )
    assert plan.varlen.q_lens == (5, 3) and plan.varlen.k_lens == (5, 20)
    assert plan.decode_rows.tolist() == [0, 1] and plan.expand_rows.tolist() == list(range(2, 10))


def test_backend_without_mla_decode_is_named():
    sdpa = select_backend("mm", "sdpa", Request("varlen_attention", "cpu", torch.float32, 24))
    with pytest.raises(UnsupportedFeatureError, match=r"'sdpa' does not support the mla_decode op; .*'torch'"):
        plan_latent_attention(sdpa, None, num_heads=4, kv_lora_rank=32)


def test_backend_without_the_models_ops_is_refused_at_start_up(ckpt_root):
    # Before any weights run: the model's ops (varlen prefill, MLA decode) are part of the selection.
    path = checkpoint("yarn", ckpt_root)
    with pytest.raises(UnsupportedFeatureError, match=r"'sdpa' does not support the mla_decode op; .*'torch'"):
        LLM(path, attention_backend="sdpa")


def test_mla_pool_layout_and_size():
    spec = mla_cache_spec(3, kv_lora_rank=32, rope_dim=8)
    assert spec.bytes_per_page(16, torch.bfloat16) == 3 * 16 * 40 * 2
    pool = make_kv_pool(spec, num_pages=5, page_size=16, dtype=torch.float32, device="cpu")
    assert isinstance(pool, MLAKVPool) and [tuple(pool.kv_cache(i).latent.shape) for i in range(3)] == [(5, 16, 40)] * 3
    with pytest.raises(ValueError, match="expected kv_lora_rank to be a positive int, got 0"):
        mla_cache_spec(3, kv_lora_rank=0, rope_dim=8)
    with pytest.raises(ValueError, match="expected an MLA spec with one latent head"):
        KVCacheSpec(3, 2, 40, 40, kind="mla", kv_lora_rank=32)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"topk_method": "greedy"}, r"expected topk_method in \['noaux_tc'\], got 'greedy'"),
        ({"scoring_func": "softmax"}, r"expected scoring_func in \['sigmoid'\], got 'softmax'"),
        ({"n_group": 3}, "expected n_group dividing n_routed_experts 8, got 3"),
        ({"n_group": 8, "topk_group": 2}, "expected at least 2 experts per group"),
        ({"topk_group": 5}, r"expected topk_group in \[1, n_group 4\], got 5"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "expected a rope_type in"),
    ],
)
def test_unsupported_configs_raise(overrides, match):
    with torch.device("meta"), pytest.raises(ValueError, match=match):
        DeepseekV3ForCausalLM(config("yarn", **overrides))


def test_checkpoint_names_skip_multi_token_prediction_and_stack_experts():
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config("yarn"))
    assert model.checkpoint_name("model.layers.3.eh_proj.weight") is None  # layer num_hidden_layers: MTP
    assert model.checkpoint_name("model.layers.2.mlp.gate.weight") == ("model.layers.2.mlp.gate.weight", None)
    # One nn.Linear per expert in the checkpoint -> shards of the stacked experts.
    assert model.checkpoint_name("model.layers.2.mlp.experts.5.up_proj.weight") == (
        "model.layers.2.mlp.experts.gate_up_proj",
        (5, "up"),
    )
    assert model.checkpoint_name("model.layers.2.mlp.experts.0.down_proj.weight") == (
        "model.layers.2.mlp.experts.down_proj",
        (0, "down"),
    )
    # The MLA's own projections stay whole; the shared experts' gate/up merge.
    assert model.checkpoint_name("model.layers.0.self_attn.q_a_proj.weight")[1] is None
    assert model.checkpoint_name("model.layers.2.mlp.shared_experts.up_proj.weight") == (
        "model.layers.2.mlp.shared_experts.gate_up_proj.weight",
        1,
    )


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")
def test_fused_router_routes_as_the_torch_code(ckpt_root, monkeypatch):
    """``deepseek_v3.FUSED_ROUTER``: the grouped top-k in one launch (``fused_launch.grouped_topk``;
    through Triton's interpreter on the CPU) gives the greedy tokens and logits of the router's torch code,
    once a mixture layer per forward."""
    from portattn.kernels.triton import fused_launch
    from portattn.models import deepseek_v3

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(deepseek_v3, "fused_ops", lambda x: fused_launch)
    calls = []
    launch = fused_launch.grouped_topk
    monkeypatch.setattr(fused_launch, "grouped_topk", lambda *a, **k: calls.append(a[0].shape[0]) or launch(*a, **k))
    monkeypatch.setattr(deepseek_v3, "FUSED_ROUTER", False)
    llm = make_llm(checkpoint("yarn", ckpt_root), page_size=16, prefix=False, chunked=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
    plain = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert not calls
    monkeypatch.setattr(deepseek_v3, "FUSED_ROUTER", True)
    fused = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    moe_layers = CONFIG.num_hidden_layers - CONFIG.first_k_dense_replace
    assert calls and len(calls) % moe_layers == 0
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        assert rel_err(a.logits, b.logits) < TOL


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")
@pytest.mark.parametrize("variant", ["yarn", "plain"])  # interleaved pairs; rotate-half without q LoRA
def test_fused_rotary_write_equals_the_rope_then_the_write(variant, ckpt_root, monkeypatch):
    """``latent_attention.FUSED_ROTARY_WRITE``: the Triton backend rotates q_pe and k_pe and writes the
    latent rows in one launch (``write_latent_rotary``; through Triton's interpreter on the CPU), with
    kv_a_layernorm folded in (``FOLD_LATENT_NORM``: the norm module not called), with the greedy tokens
    and logits of the rope's torch code and ``write_latent``, once a layer per forward (prefill, chunked
    prefill and decode)."""
    from portattn.backends.triton import TritonBackend
    from portattn.kernels.triton import fused_launch
    from portattn.models.layers import latent_attention

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(latent_attention, "fused_ops", lambda x: fused_launch)
    calls = []
    fused = TritonBackend.write_latent_rotary
    monkeypatch.setattr(TritonBackend, "write_latent_rotary", lambda *a, **k: calls.append(1) or fused(*a, **k))
    monkeypatch.setattr(latent_attention, "FUSED_ROTARY_WRITE", False)
    llm = make_llm(checkpoint(variant, ckpt_root), page_size=7, prefix=False, chunked=True, attention_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
    norms = []
    for name, module in llm.engine.model.named_modules():
        if name.endswith("kv_a_layernorm"):
            module.register_forward_hook(lambda *args: norms.append(1))
    plain = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert not calls and norms
    monkeypatch.setattr(latent_attention, "FUSED_ROTARY_WRITE", True)
    norms.clear()
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert calls and len(calls) % CONFIG.num_hidden_layers == 0 and not norms
    for a, b in zip(outs, plain):
        assert a.token_ids == b.token_ids
        assert rel_err(a.logits, b.logits) < 1e-5


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")
def test_absorbed_value_rows_equal_the_batched_matmul(ckpt_root, monkeypatch):
    """``latent_attention.ABSORBED_VALUE_ROWS``: a one-token absorbed step's value product through
    ``expert_rows`` (each head's rows of kv_b_proj's value half; through Triton's interpreter on the
    CPU) gives the greedy tokens and logits of the batched matmul, once a layer per one-token step."""
    from portattn.kernels.triton import fused_launch
    from portattn.models.layers import latent_attention

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(latent_attention, "fused_ops", lambda x: fused_launch)
    calls = []
    launch = fused_launch.expert_rows
    monkeypatch.setattr(fused_launch, "expert_rows", lambda *a, **k: calls.append(a[1]) or launch(*a, **k))
    # eager: a GPU engine's captured steps would keep the switch's value at construction
    llm = make_llm(checkpoint("yarn", ckpt_root), page_size=16, prefix=False, chunked=False, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
    plain = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS[:2]]  # one sequence: one-token steps
    assert all(ids is not None for ids in calls)  # only the routed experts' launches so far
    monkeypatch.setattr(latent_attention, "ABSORBED_VALUE_ROWS", True)
    rows = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS[:2]]
    heads = [ids for ids in calls if ids is None]
    assert heads and len(heads) % CONFIG.num_hidden_layers == 0
    for a, b in zip(rows, plain):
        assert a.token_ids == b.token_ids
        assert rel_err(a.logits, b.logits) < TOL
