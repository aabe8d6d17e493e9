"""Decoder layers fold their norms into the projections after them, and the gated activation into the
gate/up projection, at small batches (``norm_then_linear``, ``kernels/triton/fused_linear.py``): the
engine's greedy tokens and logits with the folding equal those without it, and it runs exactly where it
should (forwards of at most ``fused_linear_rows()`` tokens, two projections a layer; with the Triton
backend the q/k/v projection also rotates and writes the cache, except where q/k norms come between).

On the CPU the fused kernels run through Triton's interpreter, switched on for the test (the model
path keeps its torch code there); on a GPU they are the model path.
"""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS
from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.models.layers import fused
from tiny_models import ENGINE_DEVICE, checkpoint, random_prompts

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

PROMPTS = random_prompts([5, 30, 2])  # 37 tokens prefilled together (not folded), then decodes of 3
# Decode steps of a generate (max_tokens - 1): the third writes position 7 of the 5-token prompt, the first
# slot of its second page. Few, as every step's kernels run through the interpreter on the CPU.
DECODES = 3


def make_llm(path: str, backend: str) -> LLM:
    return LLM(
        path, dtype="float16", device=ENGINE_DEVICE, page_size=7, num_pages=40, max_model_len=128, max_num_seqs=4,
        enforce_eager=True, attention_backend=backend,
    )  # fmt: skip


def assert_same_greedy(outs, ref) -> None:
    """Greedy tokens equal, logits within the products' rounding (2% of the largest)."""
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        scale = float(b.logits.abs().max())
        assert float((a.logits.float() - b.logits.float()).abs().max()) <= 2e-2 * scale


@pytest.mark.parametrize(
    "backend", ["triton", "torch"]
)  # the projection, rotation and cache write in one launch, or not
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # plain, q/k/v biases, q/k norms
def test_folded_norms_equal_the_layers(family, backend, ckpt_root, monkeypatch):
    from portattn.kernels.triton import fused_launch

    if ENGINE_DEVICE == "cpu":  # the interpreter: fused kernels on for this test only
        monkeypatch.setattr(fused, "fused_ops", lambda x: fused_launch)
    rows = {"norm_linear": [], "norm_linear_rotary": []}

    def counting(name):
        launch = getattr(fused_launch, name)

        def counted(x, *args, **kwargs):
            rows[name].append(x.shape[0])
            return launch(x, *args, **kwargs)

        return counted

    for name in rows:
        monkeypatch.setattr(fused_launch, name, counting(name))
    if backend == "triton":  # the backend imported its launcher by name
        from portattn.backends import triton as triton_backend

        monkeypatch.setattr(triton_backend, "norm_linear_rotary", fused_launch.norm_linear_rotary)
    llm = make_llm(checkpoint(family, ckpt_root), backend)
    layers = len(llm.engine.model.model.layers)
    assert all(layer.norm_fusion == (True, True) for layer in llm.engine.model.model.layers)
    params = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, return_logits=True)
    for launches in rows.values():
        launches.clear()  # the engine's warm-up forwards (on GPUs)

    folded = llm.generate(PROMPTS, params, use_tqdm=False)
    both = rows["norm_linear"] + rows["norm_linear_rotary"]
    assert both and all(n == len(PROMPTS) for n in both)  # the decodes of three, never the prefill
    # q/k/v, gate/up and down (linear.SMALL_DOWN_PROJ) a layer, every decode step
    assert len(both) == 3 * layers * DECODES
    with_rotary = backend == "triton" and family != "qwen3"  # q/k norms come between projection and rotation
    assert len(rows["norm_linear_rotary"]) == (layers * DECODES if with_rotary else 0)
    monkeypatch.setattr(fused, "_linear_rows", [0])
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(rows["norm_linear"]) + len(rows["norm_linear_rotary"]) == 3 * layers * DECODES  # none unfolded
    assert_same_greedy(folded, plain)


def test_families_with_their_own_blocks_keep_their_norms(ckpt_root):
    """A mixture of experts keeps its post-attention norm apart (its attention's input norm folds)."""
    llm = LLM(checkpoint("mixtral", ckpt_root), num_pages=16, max_model_len=64, enforce_eager=True)
    assert {layer.norm_fusion for layer in llm.engine.model.model.layers} == {(True, False)}


def test_the_bound_is_checked_and_zero_turns_the_folding_off(monkeypatch):
    with pytest.raises(ValueError, match=r"in \[0, 16\]"):
        fused.set_fused_linear_rows(17)
    monkeypatch.setattr(fused, "fused_ops", lambda x: object())  # "fused kernels on"
    x = torch.zeros(16, 8, dtype=torch.float16)
    assert fused.fused_linear_ops(x) is not None and fused.fused_linear_ops(x.float()) is None
    assert fused.fused_linear_ops(torch.zeros(17, 8, dtype=torch.float16)) is None
    monkeypatch.setattr(fused, "_linear_rows", [0])
    assert fused.fused_linear_ops(x[:1]) is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # no biases on o_proj either way
def test_the_output_projection_merges_the_splits(family, ckpt_root, monkeypatch):
    """With the Triton backend, a decode whose attention splits its keys merges them inside the output
    projection (``merge_linear``, one launch for the merge and o_proj): greedy tokens equal, logits within
    the products' rounding, of the layers without it. Ranges of 16 keys here, so that short test sequences
    split (``launch.SHORT_SPLIT_KEYS``): the 30-token prompt's decodes over 31-33 keys in 2 or 3."""
    from portattn.backends import triton as triton_backend
    from portattn.kernels.triton import fused_launch, launch
    from portattn.models.layers import attention

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(fused, "fused_ops", lambda x: fused_launch)
    monkeypatch.setattr(launch, "SHORT_SPLIT_KEYS", 16)
    calls = []

    def counted(partial_out, partial_lse, weight):
        calls.append(partial_out.shape[:3])
        return fused_launch.merge_linear(partial_out, partial_lse, weight)

    monkeypatch.setattr(triton_backend, "merge_linear", counted)
    monkeypatch.setattr(triton_backend, "norm_linear_rotary", fused_launch.norm_linear_rotary)
    llm = make_llm(checkpoint(family, ckpt_root), "triton")
    layers = len(llm.engine.model.model.layers)
    params = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, return_logits=True)
    calls.clear()
    folded = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(calls) == layers * DECODES  # every decode step's layers; the prefill is not folded
    assert all(rows == len(PROMPTS) and splits > 1 for rows, _, splits in calls)
    monkeypatch.setattr(attention, "FOLD_OUT_PROJ", False)
    calls.clear()
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    assert not calls
    assert_same_greedy(folded, plain)


def test_the_down_projection_in_the_fused_linear_kernel(ckpt_root, monkeypatch):
    """``linear.SMALL_DOWN_PROJ`` (on by default): the MLP's down projection of small forwards runs in
    the fused linear kernel, one launch a layer more of it and none of the vendor's matmul: greedy
    tokens equal, logits within the products' rounding, of the matmul's."""
    from portattn.kernels.triton import fused_launch
    from portattn.models.layers import linear

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(fused, "fused_ops", lambda x: fused_launch)
    rows = []

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return launch(x, *args, **kwargs)

    launch = fused_launch.norm_linear
    monkeypatch.setattr(fused_launch, "norm_linear", counted)
    llm = make_llm(checkpoint("llama", ckpt_root), "torch")
    layers = len(llm.engine.model.model.layers)
    params = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, return_logits=True)
    monkeypatch.setattr(linear, "SMALL_DOWN_PROJ", False)
    rows.clear()
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(rows) == 2 * layers * DECODES  # q/k/v and gate/up
    monkeypatch.setattr(linear, "SMALL_DOWN_PROJ", True)
    rows.clear()
    small = llm.generate(PROMPTS, params, use_tqdm=False)
    # and down (the prompts' pages are cached now: their last tokens' prefill is small enough too)
    assert rows.count(len(PROMPTS)) == 3 * layers * DECODES
    assert_same_greedy(small, plain)


@pytest.mark.parametrize("backend", ["triton", "torch"])  # q/k/v with rotation and cache write, or not
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # plain, q/k/v biases
def test_one_row_projections_in_row_linear(family, backend, ckpt_root, monkeypatch):
    """Forwards of one row over at least ``fused_launch.ROW_LINEAR_K`` features (set to 1 here: the
    tiny models' rows are narrow; the norms' single-step folding turned off so that q/k/v and gate/up
    take it) run all four projections of a layer on the vector units, q/k/v and gate/up with their
    norms, gate/up with its activation, and with the Triton backend and ``ROW_LINEAR_ROTARY`` q/k/v
    with the rotation and the cache write (``row_linear_rotary``): greedy tokens and logits equal those
    of the vendor's matmul. Batch-1 decodes only: the 5-token prefill keeps the matmul."""
    from portattn.backends import triton as triton_backend
    from portattn.kernels.triton import fused_launch

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(fused, "fused_ops", lambda x: fused_launch)
    monkeypatch.setattr(fused_launch, "NORM_LINEAR_SINGLE_K", 0)
    monkeypatch.setattr(triton_backend, "NORM_LINEAR_SINGLE_K", 0)
    calls = []

    def counting(name, module):
        launch = getattr(module, name)

        def counted(x, weight, *args, **kwargs):
            calls.append((name, x.shape[0], weight.shape[1], kwargs.get("norm_weight") is not None, kwargs.get("act")))
            return launch(x, weight, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    counting("row_linear", fused_launch)
    counting("row_linear_rotary", triton_backend)  # the backend imported its launcher by name
    llm = make_llm(checkpoint(family, ckpt_root), backend)
    layers = len(llm.engine.model.model.layers)
    params = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, return_logits=True)
    monkeypatch.setattr(fused_launch, "ROW_LINEAR_ROTARY", True)  # off by default (measured slower)
    monkeypatch.setattr(fused_launch, "ROW_LINEAR_K", 1 << 30)
    calls.clear()
    plain = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert not calls
    monkeypatch.setattr(fused_launch, "ROW_LINEAR_K", 1)
    rows = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert len(calls) == 4 * layers * DECODES and all(n == 1 for _, n, *_ in calls)  # batch-1 decode steps
    hidden = llm.engine.model.config.hidden_size
    qkv = "row_linear_rotary" if backend == "triton" else "row_linear"
    normed = [(name, k, act) for name, _, k, has_norm, act in calls if has_norm]
    # q/k/v, gate/up with SiLU
    assert normed == [(qkv, hidden, None), ("row_linear", hidden, "silu")] * layers * DECODES
    assert_same_greedy(rows, plain)


def test_one_row_q_k_v_keeps_the_rotary_launch_by_default(ckpt_root, monkeypatch):
    """``fused_launch.ROW_LINEAR_ROTARY`` off (the default): a one-row q/k/v projection takes
    ``row_linear`` and the rotary write its own launch, with the Triton backend too."""
    from portattn.backends import triton as triton_backend
    from portattn.kernels.triton import fused_launch

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(fused, "fused_ops", lambda x: fused_launch)
    monkeypatch.setattr(fused_launch, "NORM_LINEAR_SINGLE_K", 0)
    monkeypatch.setattr(triton_backend, "NORM_LINEAR_SINGLE_K", 0)
    monkeypatch.setattr(fused_launch, "ROW_LINEAR_K", 1)
    names = []
    for name, module in (("row_linear", fused_launch), ("row_linear_rotary", triton_backend)):
        launch = getattr(module, name)
        counted = lambda *a, name=name, launch=launch, **k: names.append(name) or launch(*a, **k)
        monkeypatch.setattr(module, name, counted)
    llm = make_llm(checkpoint("llama", ckpt_root), "triton")
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert names and set(names) == {"row_linear"}


def _row_linear_runs(path: str, monkeypatch):
    """The engine's greedy generate of one prompt with one-row projections kept on the vendor's matmul,
    then through ``row_linear`` (``ROW_LINEAR_K`` 1: the tiny models' rows are narrow; the norms'
    single-step folding off). Returns ``(llm, plain, rows, calls)``, ``calls`` the second run's
    ``row_linear`` launches as ``(weight, has_norm, act)``."""
    from portattn.kernels.triton import fused_launch

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(fused, "fused_ops", lambda x: fused_launch)
    monkeypatch.setattr(fused_launch, "NORM_LINEAR_SINGLE_K", 0)
    calls = []
    launch = fused_launch.row_linear

    def counted(x, weight, *args, **kwargs):
        calls.append((weight, kwargs.get("norm_weight") is not None, kwargs.get("act")))
        return launch(x, weight, *args, **kwargs)

    monkeypatch.setattr(fused_launch, "row_linear", counted)
    llm = make_llm(path, "torch")
    params = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, return_logits=True)
    monkeypatch.setattr(fused_launch, "ROW_LINEAR_K", 1 << 30)
    plain = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert not calls
    monkeypatch.setattr(fused_launch, "ROW_LINEAR_K", 1)
    return llm, plain, llm.generate(PROMPTS[:1], params, use_tqdm=False), calls


def test_llama4_one_row_projections_in_row_linear(ckpt_root, monkeypatch):
    """Llama 4's own attention (q/k norms between its projection and the rotation) and its mixture's
    shared expert (called without its norm) take ``row_linear`` at one row as well: q/k/v and o, the
    shared expert's gate/up with its activation and its down, every layer at every batch-1 decode
    step; greedy tokens and logits equal those of the vendor's matmul."""
    llm, plain, rows, calls = _row_linear_runs(checkpoint("llama4", ckpt_root), monkeypatch)
    layers = llm.engine.model.model.layers
    shared = [layer.mlp.shared_expert for layer in layers if hasattr(layer.mlp, "shared_expert")]
    assert shared, "expected mixture layers in the tiny Llama 4"
    gated_alone = [(id(m.gate_up_proj.weight), False, m.act.name) for m in shared]
    per_step = [(id(w), norm, act) for w, norm, act in calls if not norm and act is not None]  # no norm
    assert per_step == gated_alone * DECODES  # every batch-1 decode step
    plain_rows = {id(w) for w, norm, act in calls if not norm and act is None}
    for attn in (layer.self_attn for layer in layers):
        assert id(attn.qkv_proj.weight) in plain_rows and id(attn.o_proj.weight) in plain_rows
    assert len(calls) == 4 * len(layers) * DECODES
    assert_same_greedy(rows, plain)


def test_latent_attention_one_row_projections_in_row_linear(ckpt_root, monkeypatch):
    """DeepSeek V3's latent attention takes ``row_linear`` at one row for its q (LoRA halves), latent
    and output projections, and its shared experts with their activation; greedy tokens and logits
    equal those of the vendor's matmul."""
    from .test_deepseek_v3 import checkpoint as deepseek_checkpoint

    llm, plain, rows, calls = _row_linear_runs(deepseek_checkpoint("yarn", ckpt_root), monkeypatch)
    seen = {id(w) for w, _, _ in calls}
    for layer in llm.engine.model.model.layers:
        attn = layer.self_attn
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            assert id(getattr(attn, name).weight) in seen, name
        shared = getattr(layer.mlp, "shared_experts", None)
        if shared is not None:
            assert id(shared.gate_up_proj.weight) in seen and id(shared.down_proj.weight) in seen
    assert_same_greedy(rows, plain)


def test_llama4_rotary_pairs_in_one_launch(ckpt_root, monkeypatch):
    """Llama 4's rope layers rotate q and k and norm them in one launch (``fused_launch.rotary_pairs``)
    on GPUs: once a rope layer per forward, greedy tokens and logits those of the torch code."""
    from portattn.kernels.triton import fused_launch
    from portattn.models import llama4

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(llama4, "fused_ops", lambda x: fused_launch)
    calls = []
    launch = fused_launch.rotary_pairs
    monkeypatch.setattr(fused_launch, "rotary_pairs", lambda *a, **k: calls.append(a[3]) or launch(*a, **k))
    llm = make_llm(checkpoint("llama4", ckpt_root), "torch")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
    monkeypatch.setattr(llama4, "FUSED_ROTARY_PAIRS", False)
    calls.clear()  # a GPU engine's start-up forwards ran with the default (on)
    plain = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert not calls
    monkeypatch.setattr(llama4, "FUSED_ROTARY_PAIRS", True)
    fused_pairs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    layers = llm.engine.model.model.layers
    rope = [layer.self_attn for layer in layers if layer.self_attn.use_rope]
    assert rope and len(rope) < len(layers)  # the tiny model has NoPE layers too
    assert calls and len(calls) % len(rope) == 0
    assert set(calls) == {a.qk_norm_eps for a in rope}
    assert_same_greedy(fused_pairs, plain)


def test_llama4_router_and_temperature_in_one_launch_each(ckpt_root, monkeypatch):
    """Llama 4's router (the logits, the top-k, the sigmoid) and its NoPE layers' attention temperature run
    in one launch each on GPUs (``llama4.FUSED_ROUTER``), and its routed experts take their scaled inputs in
    the gate/up launch: once a mixture (a NoPE) layer per decode step, greedy tokens and logits those of the
    torch code."""
    from portattn.kernels.triton import fused_launch
    from portattn.models import llama4
    from portattn.models.layers import moe

    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(llama4, "fused_ops", lambda x: fused_launch)
        monkeypatch.setattr(moe, "fused_ops", lambda x: fused_launch)
    calls = {"router_topk": [], "attn_temperature": [], "expert_rows": []}
    for name, seen in calls.items():
        launch = getattr(fused_launch, name)
        monkeypatch.setattr(
            fused_launch, name, lambda *a, launch=launch, seen=seen, **k: seen.append(k) or launch(*a, **k)
        )
    llm = make_llm(checkpoint("llama4", ckpt_root), "torch")
    params = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, return_logits=True)
    monkeypatch.setattr(llama4, "FUSED_ROUTER", False)
    for seen in calls.values():
        seen.clear()  # a GPU engine's start-up forwards ran with the default (on)
    plain = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert not calls["router_topk"] and not calls["attn_temperature"]
    assert calls["expert_rows"] and any(k.get("scale_input") for k in calls["expert_rows"])
    monkeypatch.setattr(llama4, "FUSED_ROUTER", True)
    for seen in calls.values():
        seen.clear()
    fused_router = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    layers = llm.engine.model.model.layers
    mixtures = [layer for layer in layers if isinstance(layer.mlp, llama4.Llama4MoE)]
    nope = [layer for layer in layers if layer.self_attn.temperature is not None]
    assert mixtures and nope, "expected mixture and NoPE layers in the tiny Llama 4"
    forwards = DECODES + 1  # the prefill of both prompts, then the decodes of two
    assert len(calls["router_topk"]) == len(mixtures) * forwards
    assert len(calls["attn_temperature"]) == len(nope) * forwards
    assert_same_greedy(fused_router, plain)


def fp8_launches(monkeypatch) -> dict[str, list[bool]]:
    """For the fp8 tests below: the output projection left in float16 (it would take the fp8 matmul, its rows
    quantized: a last-bit difference moves a value by an fp8 step), the fused kernels on (through the
    interpreter on the CPU), and each ``norm_linear`` / ``row_linear`` launch recorded (whether it had
    scales)."""
    from portattn.kernels.triton import fused_launch
    from portattn.models.layers import linear

    quantizable = linear.quantizable_linears
    monkeypatch.setattr(
        linear, "quantizable_linears", lambda model: [(n, m) for n, m in quantizable(model) if "o_proj" not in n]
    )
    if ENGINE_DEVICE == "cpu":
        monkeypatch.setattr(fused, "fused_ops", lambda x: fused_launch)
    calls = {"norm_linear": [], "row_linear": []}

    def counting(name):
        launch = getattr(fused_launch, name)

        def counted(x, weight, *args, weight_scale=None, **kwargs):
            calls[name].append(weight_scale is not None)
            return launch(x, weight, *args, weight_scale=weight_scale, **kwargs)

        return counted

    for name in calls:
        monkeypatch.setattr(fused_launch, name, counting(name))
    return calls


def fp8_generate(path: str, prompts, calls: dict[str, list[bool]]):
    """``(engine, outputs)`` of the float16 engine with ``quantization="fp8"``, the launches of its warm-up
    forgotten."""
    fp8 = LLM(
        path, dtype="float16", device=ENGINE_DEVICE, page_size=7, num_pages=40, max_model_len=128, max_num_seqs=4,
        enforce_eager=True, attention_backend="torch", quantization="fp8",
    )  # fmt: skip
    for launches in calls.values():
        launches.clear()
    return fp8, fp8.generate(prompts, FP8_PARAMS, use_tqdm=False)


def assert_equal_to_the_dequantized_engine(fp8: LLM, path: str, prompts, got) -> None:
    """``got`` against the float16 engine whose weights are ``fp8``'s quantized ones dequantized."""
    ref = make_llm(path, "torch")
    for name, module in fp8.engine.model.named_modules():
        if getattr(module, "weight_scale", None) is not None:
            dequantized = module.weight.float() * module.weight_scale.t()
            ref.engine.model.get_submodule(name).weight.copy_(dequantized.to(torch.float16))
    assert_same_greedy(got, ref.generate(prompts, FP8_PARAMS, use_tqdm=False))


FP8_PARAMS = SamplingParams(temperature=0, max_tokens=DECODES + 1, ignore_eos=True, return_logits=True)


def test_fp8_weights_take_the_fused_launches_with_their_scales(ckpt_root, monkeypatch):
    """``quantization="fp8"`` at small batches: the projections that fold (q/k/v and gate/up with their norms,
    the down projection) run in a fused launch over the fp8 weight and its scales, the rows not quantized,
    and the engine's logits equal those of the float16 engine whose weights there are the dequantized fp8
    ones (the output projection left in float16: :func:`fp8_launches`); prompts of at most 16 tokens in all,
    so that every forward folds."""
    calls = fp8_launches(monkeypatch)
    path, prompts = checkpoint("llama", ckpt_root), random_prompts([5, 3, 2])
    fp8, got = fp8_generate(path, prompts, calls)
    layers = len(fp8.engine.model.model.layers)
    launches = calls["norm_linear"] + calls["row_linear"]
    assert len(launches) == 3 * layers * (1 + DECODES) and all(launches)  # q/k/v, gate/up, down a forward
    assert_equal_to_the_dequantized_engine(fp8, path, prompts, got)


@pytest.mark.parametrize("row_linear", [True, False], ids=["row_linear", "tiles"])
def test_fp8_one_row_steps_take_row_linear_or_the_tiles(row_linear, ckpt_root, monkeypatch):
    """``linear.FP8_ROW_LINEAR``: one-row steps over fp8 weights in ``row_linear`` (on: here over 16 features and
    more, as over 16-bit weights), or every small step in ``norm_linear``'s tiles (off); either way the logits of
    the float16 engine over the dequantized weights."""
    from portattn.kernels.triton import fused_launch
    from portattn.models.layers import linear

    calls = fp8_launches(monkeypatch)
    monkeypatch.setattr(linear, "FP8_ROW_LINEAR", row_linear)
    monkeypatch.setattr(fused_launch, "ROW_LINEAR_K", 16)  # the tiny model's one-row steps in row_linear
    path, prompts = checkpoint("llama", ckpt_root), random_prompts([5])  # decode steps of one row
    fp8, got = fp8_generate(path, prompts, calls)
    layers = len(fp8.engine.model.model.layers)
    scaled = {name: launches.count(True) for name, launches in calls.items()}  # (False: the float16 o_proj)
    if row_linear:  # the down projection of each one-row step; q/k/v and gate/up fold their norms in the tiles
        assert scaled == {"row_linear": layers * DECODES, "norm_linear": 2 * layers * (1 + DECODES) + layers}
    else:
        assert scaled == {"row_linear": 0, "norm_linear": 3 * layers * (1 + DECODES)}
    assert_equal_to_the_dequantized_engine(fp8, path, prompts, got)
