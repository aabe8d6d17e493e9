"""The KV cache's size: byte counts with units, vLLM's gpu_memory_utilization rule on numbers injected
in place of an accelerator's (the engine runs its profile forward on the CPU), the CPU's fixed
default, and the start-up line."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import portattn.device
import portattn.engine.engine
from portattn.cli import main
from portattn.engine import memory
from portattn.engine.config import EngineConfig
from portattn.engine.llm import LLM
from portattn.engine.memory import CPU_KV_CACHE_MEMORY, MemoryUse, kv_cache_budget, parse_bytes, pool_pages
from portattn.engine.model_runner import ModelRunner
from portattn.engine.sampling_params import SamplingParams
from portattn.engine.spec_decode import rejection
from portattn.models.layers.moe import FusedMoE
from portattn.paging import num_pages_for
from tiny_models import checkpoint

GIB = 1 << 30


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4G", 4 * GIB),
        ("4GiB", 4 * GIB),
        ("4gib", 4 * GIB),
        ("4 GiB", 4 * GIB),
        ("512MiB", 512 << 20),
        ("512M", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("2KB", 2000),
        ("1073741824", GIB),
        ("100b", 100),
        (12345, 12345),
    ],
)
def test_byte_counts_take_units(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["4X", "", "G", "-1G", "4 G iB", "1e9", True])
def test_bad_byte_counts_say_what_is_expected(text):
    with pytest.raises(ValueError, match=r"expected a byte count such as 4294967296, 4G, 4GiB, 512MiB or 1.5GB, got"):
        parse_bytes(text)


def test_the_flag_and_the_keyword_take_units(ckpt_root, capsys):
    path = checkpoint("llama", ckpt_root)
    assert EngineConfig(model=path, device="cpu", kv_cache_memory="1MiB").kv_cache_memory == 1 << 20
    with pytest.raises(ValueError, match=r"kv_cache_memory \(--kv-cache-memory\): expected a byte count"):
        EngineConfig(model=path, device="cpu", kv_cache_memory="lots")
    with pytest.raises(SystemExit, match="2"):
        main(["generate", "--model", path, "--prompt-ids", "1", "--kv-cache-memory", "4X"])
    assert "argument --kv-cache-memory: expected a byte count such as" in capsys.readouterr().err
    # Too small a cache names the flag (and the keyword).
    assert main(["generate", "--model", path, "--prompt-ids", "1", "--kv-cache-memory", "64KiB"]) == 2
    err = capsys.readouterr().err
    assert "from kv_cache_memory (--kv-cache-memory) 65536 bytes" in err and "max_model_len (--max-model-len)" in err


# -- the accelerator rule on injected numbers --------------------------------------------------------

# Llama-3-8B: 8,030,261,248 parameters; KV 32 layers x 8 heads x 128 dims x (K + V).
LLAMA3_8B_PARAMS = 8_030_261_248
H200_TOTAL = 150_754_820_096  # 140.4 GiB, as torch.cuda.mem_get_info reports it


def test_a_float32_llama3_8b_fits_an_h200_by_default():
    config = EngineConfig(model="m", device="cpu")  # the defaults (pool sizing reads no device)
    bytes_per_page = 32 * 16 * 8 * (128 + 128) * 4
    max_len = 8192  # the model's max_position_embeddings
    use = MemoryUse(
        total=H200_TOTAL,
        available=H200_TOTAL - GIB // 2,  # the driver's context
        weights=LLAMA3_8B_PARAMS * 4,
        activations=6 * GIB,  # generous for 8192 float32 tokens
        graphs=GIB,
        non_torch=GIB,
    )
    pages = pool_pages(config, max_len, bytes_per_page, use)
    budget = int(H200_TOTAL * 0.9) - LLAMA3_8B_PARAMS * 4 - 8 * GIB
    assert pages == budget // bytes_per_page  # everything that is left
    assert pages * 16 > 20 * max_len  # 20+ requests of the full context at once
    # The fixed 512 MiB of the past held 128 of the 512 pages one request needs.
    with pytest.raises(ValueError, match="expected the KV cache to hold at least 512 pages"):
        pool_pages(EngineConfig(model="m", device="cpu", kv_cache_memory="512MiB"), max_len, bytes_per_page)


def test_the_budget_is_utilization_less_everything_else():
    use = MemoryUse(total=100 * GIB, available=99 * GIB, weights=30 * GIB, activations=5 * GIB, graphs=GIB, non_torch=2)
    assert kv_cache_budget(use, 0.9) == int(90 * GIB) - 36 * GIB - 2
    assert kv_cache_budget(use, 0.5) == 50 * GIB - 36 * GIB - 2
    busy = MemoryUse(total=100 * GIB, available=60 * GIB, weights=0, activations=0, graphs=0, non_torch=0)
    with pytest.raises(
        ValueError,
        match=r"expected gpu_memory_utilization \(--gpu-memory-utilization\) 0.9 of the device \(90.00 GiB of "
        r"100.00 GiB\) to be free at start-up, got 60.00 GiB free",
    ):
        kv_cache_budget(busy, 0.9)
    assert kv_cache_budget(busy, 0.5) == 50 * GIB
    with pytest.raises(ValueError, match=r"expected room for the KV cache .* weights 30.00 GiB, activations 5.00 GiB"):
        kv_cache_budget(use, 0.3)


class FakeAccelerator:
    """The numbers device.py would report for an accelerator: weights 'allocated' when the model loads,
    activations in proportion to a forward's tokens, library workspaces on the first forward."""

    def __init__(self, monkeypatch, total: int, others: int, per_token: int, workspace: int):
        self.total, self.others, self.per_token, self.workspace = total, others, per_token, workspace
        self.allocated = self.peak = self.non_torch = 0
        self.forward_tokens = []
        monkeypatch.setattr(portattn.device, "memory_info", self.memory_info)
        monkeypatch.setattr(portattn.device, "allocator_memory", self.allocator_memory)
        monkeypatch.setattr(portattn.device, "reset_peak_memory", self.reset_peak_memory)
        step = ModelRunner.step

        def counted_step(runner, scheduled, *args, **kwargs):
            tokens = sum(n for _, n in scheduled)
            self.forward_tokens.append(tokens)
            self.peak = max(self.peak, self.allocated + tokens * per_token)
            self.non_torch = self.workspace
            return step(runner, scheduled, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "step", counted_step)

    def memory_info(self, device):
        return self.total - self.others - self.allocated - self.non_torch, self.total

    def allocator_memory(self, device):
        return self.allocated, self.allocated, self.peak

    def reset_peak_memory(self, device):
        self.peak = self.allocated


def test_the_engine_sizes_its_pool_from_the_device_numbers(ckpt_root, monkeypatch, caplog):
    path = checkpoint("llama", ckpt_root)
    fake = FakeAccelerator(monkeypatch, total=64 << 20, others=1 << 20, per_token=2048, workspace=3 << 20)
    weights = 5 << 20
    load_model = portattn.engine.engine.loader.load_model

    def loading(*args, **kwargs):
        fake.allocated += weights
        return load_model(*args, **kwargs)

    monkeypatch.setattr(portattn.engine.engine.loader, "load_model", loading)
    kwargs = dict(device="cpu", page_size=8, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=300)
    with caplog.at_level(logging.INFO, logger="portattn"):
        llm = LLM(path, gpu_memory_utilization=0.5, **kwargs)
    engine = llm.engine
    assert fake.forward_tokens[0] == 300  # the profile step: the whole budget, over max_num_seqs prompts
    use = engine.memory_use
    assert use == MemoryUse(
        total=64 << 20, available=63 << 20, weights=weights, activations=300 * 2048, graphs=0, non_torch=3 << 20
    )  # graphs: none on the CPU
    bytes_per_page = engine.model.kv_cache_spec().bytes_per_page(8, torch.float32)
    want = (int((64 << 20) * 0.5) - weights - 300 * 2048 - (3 << 20)) // bytes_per_page
    assert engine.allocator.num_pages == want
    tokens = want * 8
    assert f"KV cache {tokens:,} tokens ({want} pages of 8, float32)" in caplog.text
    assert f"maximum concurrency {tokens / 256:.2f}x for 256-token requests" in caplog.text
    # The profile's pool is gone, and the engine still generates.
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4

    # The graphs' share: a decode step of max_num_seqs sequences.
    graphs = memory.measure(
        memory.Snapshot(free=60 << 20, total=64 << 20, allocated=0, reserved=0),
        engine.model,
        engine.backend,
        engine.model.kv_cache_spec(),
        torch.float32,
        llm.config,
        256,
        graphs=True,
    )
    assert fake.forward_tokens[-2:] == [300, 4] and graphs.graphs == 4 * 2048
    speculating = dataclasses.replace(llm.config, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    snapshot = memory.Snapshot(free=60 << 20, total=64 << 20, allocated=0, reserved=0)
    spec = engine.model.kv_cache_spec()
    graphs = memory.measure(snapshot, engine.model, engine.backend, spec, torch.float32, speculating, 256, graphs=True)
    assert fake.forward_tokens[-1] == 4 * 4 and graphs.graphs == 16 * 2048  # verifications of k + 1 tokens

    # More than the device can give is refused, naming the flag.
    with pytest.raises(ValueError, match=r"raise gpu_memory_utilization \(--gpu-memory-utilization\)"):
        LLM(path, gpu_memory_utilization=0.08, **kwargs)


def test_the_cpu_default_is_fixed_and_capped_by_what_can_run(ckpt_root):
    path = checkpoint("llama", ckpt_root)
    llm = LLM(path, device="cpu", page_size=8, max_model_len=256, max_num_seqs=4)
    assert llm.engine.memory_use is None
    assert llm.engine.allocator.num_pages == 4 * num_pages_for(256, 8)  # far below 4 GiB of this tiny model
    config = EngineConfig(model="m", device="cpu", page_size=8, max_num_seqs=4)
    assert pool_pages(config, 256, CPU_KV_CACHE_MEMORY // 40) == 40  # a bigger model: what 4 GiB hold
    with pytest.raises(ValueError, match=r"got 4294967296 bytes \(8 pages\) from the CPU default of 4.00 GiB"):
        pool_pages(config, 256, CPU_KV_CACHE_MEMORY // 8)  # one request of 256 tokens needs 32 pages


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_profile_verifies_every_row_of_the_largest_speculative_step(method, ckpt_root, monkeypatch):
    """A verification step computes logits for each of its k + 1 rows per sequence and runs the rejection
    sampler on them, eagerly, captured steps or not: the profile runs that step (with draft distributions
    for a draft model) and counts its peak; captured steps take a mixture-of-experts layer's dense path
    up to their largest shape, and so does the profile."""
    path = checkpoint("qwen3_moe", ckpt_root)
    llm = LLM(path, device="cpu", page_size=8, max_model_len=64, max_num_seqs=4, num_pages=40)
    engine = llm.engine
    fake = FakeAccelerator(monkeypatch, total=64 << 20, others=0, per_token=2048, workspace=0)
    verified, dense = [], []
    verify = rejection.verify

    def recording_verify(logits, seqs, drafts, eos_token_ids):
        verified.append(
            (
                logits.shape[0],
                [seq.num_draft_tokens for seq in seqs],
                [None if d is None else tuple(d.shape) for d in drafts],
            )
        )
        return verify(logits, seqs, drafts, eos_token_ids)

    forward_dense = FusedMoE.forward_dense

    def recording_dense(self, x, *args):
        dense.append(x.shape[0])
        return forward_dense(self, x, *args)

    monkeypatch.setattr(rejection, "verify", recording_verify)
    monkeypatch.setattr(FusedMoE, "forward_dense", recording_dense)
    num_seqs, k = 6, 3  # 6 x 4 = 24 tokens: above the dense path's default bound (16)
    spec = (
        {"method": "ngram", "num_speculative_tokens": k}
        if method == "ngram"
        else {"model": path, "num_speculative_tokens": k}
    )
    config = dataclasses.replace(llm.config, max_num_seqs=num_seqs, num_pages=None, speculative_config=spec)
    snapshot = memory.Snapshot(free=60 << 20, total=64 << 20, allocated=0, reserved=0)
    for graphs in (False, True):
        verified.clear()
        use = memory.measure(
            snapshot,
            engine.model,
            engine.backend,
            engine.model.kv_cache_spec(),
            torch.float32,
            config,
            64,
            graphs=graphs,
        )
        assert fake.forward_tokens[-1] == num_seqs * (k + 1)
        drafts = [(k, engine.vocab_size) if method == "draft_model" else None] * num_seqs
        assert verified == [(num_seqs * (k + 1), [k] * num_seqs, drafts)]
        # The largest step: 6 prompts of 63 tokens (max_model_len 64); the verification beside it.
        assert (use.activations, use.graphs) == (6 * 63 * 2048, num_seqs * (k + 1) * 2048 if graphs else 0)
    assert num_seqs * (k + 1) in dense  # after prepare_static, as DecodeGraphs calls it


def test_a_profile_step_compiles_its_kernels_ahead(ckpt_root, monkeypatch):
    """Where kernels compile ahead (a CUDA device with Triton), each profile step but a verification is
    first rehearsed under ``compile_ahead`` (its forward, then its sampling over zero logits), so that
    its Triton kernels compile in parallel and the measured step runs them compiled; nothing else
    changes: the measured steps are the same forwards."""
    import contextlib

    import portattn.kernels.triton.compile_ahead as ahead

    llm = LLM(checkpoint("llama", ckpt_root), page_size=4, num_pages=64, max_model_len=64)
    engine = llm.engine
    events = []
    forward, start_sampling = ModelRunner.forward, ModelRunner.start_sampling

    def counted_forward(self, scheduled, rows, cascade=None, feed=None):
        events.append(("forward", sum(n for _, n in scheduled)))
        return forward(self, scheduled, rows, cascade, feed)

    def counted_sampling(self, want, logits, fed=()):
        events.append(("sampling", bool((logits == 0).all())))
        return start_sampling(self, want, logits, fed)

    @contextlib.contextmanager
    def rehearsing(device, workers=None):
        events.append(("rehearsal", device.type))
        yield True

    monkeypatch.setattr(ModelRunner, "forward", counted_forward)
    monkeypatch.setattr(ModelRunner, "start_sampling", counted_sampling)
    args = (engine.model, engine.backend, engine.model.kv_cache_spec(), torch.float32, llm.config)
    plain = memory._run_profile_steps(*args, [[20, 12], [1, 1, 1]])
    plain_events = list(events)
    assert plain_events == [("forward", 32), ("sampling", False), ("forward", 3), ("sampling", False)]
    events.clear()
    monkeypatch.setattr(ahead, "compile_ahead", rehearsing)
    assert memory._run_profile_steps(*args, [[20, 12], [1, 1, 1]]) == plain
    rehearsed = [("rehearsal", "cpu"), ("forward", 32), ("sampling", True), ("forward", 32), ("sampling", False)]
    assert events == [*rehearsed, ("rehearsal", "cpu"), ("forward", 3), ("sampling", True), *plain_events[2:]]
