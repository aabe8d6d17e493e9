"""How many KV-cache pages the engine allocates.

The first of these that applies:

1. ``num_pages``: exactly that many.
2. ``kv_cache_memory``: as many as that many bytes hold (``"4GiB"`` and the like, :func:`parse_bytes`).
3. On an accelerator, vLLM's rule: the pool takes what ``gpu_memory_utilization`` (default 0.9) of
   the device's memory leaves after the weights, the activations of the largest step (measured by a
   profile forward of ``max_num_batched_tokens`` tokens over up to ``max_num_seqs`` sequences), the
   captured decode graphs (measured as the activations of a decode step of ``max_num_seqs``
   sequences, which their shared memory pool holds; with speculative decoding a verification step of
   ``max_num_seqs`` sequences of ``k + 1`` tokens, whose logits and rejection sampling run eagerly
   beside the graphs) and what those runs added outside torch's allocator (driver context, library
   workspaces). The numbers are :class:`MemoryUse`; the
   arithmetic is :func:`kv_cache_budget`, a pure function.
4. On the CPU (and devices that do not report their free memory), :data:`CPU_KV_CACHE_MEMORY`
   bytes, but no more than ``max_num_seqs`` requests of ``max_model_len`` use: host memory is shared
   with the rest of the machine and cannot be reserved, so a fixed, modest default is safer than a
   fraction of what happens to be free.

Whichever applies, the pool must hold one request of ``max_model_len`` and ``max_num_seqs``
requests of one page; otherwise construction fails naming the option to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .. import device as devices
from ..paging import PageAllocator, num_pages_for
from ..runtime.kv_cache import KVCacheSpec, make_kv_pool
from .arguments import option

CPU_KV_CACHE_MEMORY = 4 << 30  # bytes; vLLM's CPU backend's long-standing default (VLLM_CPU_KVCACHE_SPACE=4)

_UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgt", start=1):
    _UNITS |= {_letter: 1024**_power, f"{_letter}ib": 1024**_power, f"{_letter}b": 1000**_power}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """A byte count from an int or a string: plain bytes (``"1073741824"``), or a number and a unit,
    case-insensitive: ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/``GiB``/``TiB`` are powers of 1024,
    ``KB``/``MB``/``GB``/``TB`` powers of 1000 (``"4G"`` = ``"4GiB"`` = 4 * 2**30, ``"1.5GB"``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(value.lower()) if isinstance(value, str) else None
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"expected a byte count such as 4294967296, 4G, 4GiB, 512MiB or 1.5GB, got {value!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryUse:
    """Bytes of one accelerator, measured while the engine is built (see the module docstring).

    ``available``: what this process could use at start-up (free, plus torch's cache of freed
    blocks). ``graphs`` is 0 when decode steps run eagerly.
    """

    total: int
    available: int
    weights: int
    activations: int
    graphs: int
    non_torch: int


def kv_cache_budget(use: MemoryUse, utilization: float) -> int:
    """Bytes left for the KV cache: ``utilization * total`` less weights, activations, graphs and
    memory outside torch's allocator. Refused when other processes hold more than ``1 - utilization``
    of the device, or when nothing is left."""
    requested = int(use.total * utilization)
    flag = option("gpu_memory_utilization")
    if requested > use.available:
        raise ValueError(
            f"expected {flag} {utilization} of the device ({gib(requested)} of {gib(use.total)}) to be free at "
            f"start-up, got {gib(use.available)} free (other processes or tensors hold the rest): lower "
            f"{flag} or set {option('kv_cache_memory')}"
        )
    budget = requested - use.weights - use.activations - use.graphs - use.non_torch
    if budget <= 0:
        raise ValueError(
            f"expected room for the KV cache in {flag} {utilization} of the device ({gib(requested)}), got "
            f"none: weights {gib(use.weights)}, activations {gib(use.activations)}, graphs {gib(use.graphs)}, "
            f"outside torch {gib(use.non_torch)}: raise {flag}, lower {option('max_num_batched_tokens')} "
            f"or {option('max_num_seqs')}, or set {option('kv_cache_memory')}"
        )
    return budget


def describe_budget(use: MemoryUse, utilization: float) -> str:
    return (
        f"{option('gpu_memory_utilization')} {utilization} x {gib(use.total)} - weights {gib(use.weights)} - "
        f"activations {gib(use.activations)} - graphs {gib(use.graphs)} - outside torch {gib(use.non_torch)}"
    )


def pool_pages(config, max_model_len: int, bytes_per_page: int | None, use: MemoryUse | None = None) -> int:
    """Pages of the KV pool (see the module docstring); refused when they cannot hold one request of
    ``max_model_len`` tokens or ``max_num_seqs`` requests of a page each (the engine caps nothing silently).
    ``bytes_per_page`` may be ``None`` only with ``num_pages``."""
    size = config.page_size
    per_request = num_pages_for(max_model_len, size)
    if config.num_pages is not None:
        if config.num_pages < per_request:
            raise ValueError(
                f"expected {option('num_pages')} >= {per_request} (one request of max_model_len {max_model_len} at "
                f"page size {size}), got {config.num_pages}: pass max_model_len <= {config.num_pages * size} "
                "or more pages"
            )
        if config.num_pages < config.max_num_seqs:
            raise ValueError(
                f"expected {option('num_pages')} >= max_num_seqs {config.max_num_seqs} (a page per running "
                f"request), got {config.num_pages}"
            )
        return config.num_pages
    cap = None
    if config.kv_cache_memory is not None:
        budget, source = config.kv_cache_memory, f"{option('kv_cache_memory')} {config.kv_cache_memory} bytes"
    elif use is not None:
        budget = kv_cache_budget(use, config.gpu_memory_utilization)
        source = describe_budget(use, config.gpu_memory_utilization)
    else:
        budget, source = CPU_KV_CACHE_MEMORY, f"the CPU default of {gib(CPU_KV_CACHE_MEMORY)}"
        cap = config.max_num_seqs * per_request  # no more than the requests that can run at once use
    fits = budget // bytes_per_page
    need = max(per_request, config.max_num_seqs)
    if fits < need:
        raise ValueError(
            f"expected the KV cache to hold at least {need} pages of {bytes_per_page} bytes (one request of "
            f"{option('max_model_len')} {max_model_len}, and max_num_seqs {config.max_num_seqs}), got {budget} bytes "
            f"({fits} pages) from {source}: raise {option('kv_cache_memory')} (or, on an accelerator, "
            f"{option('gpu_memory_utilization')}) or lower max_model_len / max_num_seqs"
        )
    return fits if cap is None else min(fits, cap)


def agree_across_ranks(num_pages: int, tp) -> int:
    """The smallest ``num_pages`` of the tensor-parallel ranks: every rank's pool holds the pages
    rank 0 hands out."""
    if tp.size == 1:
        return num_pages
    import torch.distributed as dist

    pages = torch.tensor([num_pages], dtype=torch.int64)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(pages)


# -- measuring ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    free: int
    total: int
    allocated: int
    reserved: int


def snapshot(device: torch.device) -> Snapshot | None:
    """The device's memory now (``None`` where it does not report its free memory: the CPU)."""
    info = devices.memory_info(device)
    if info is None:
        return None
    allocated, reserved, _ = devices.allocator_memory(device)
    return Snapshot(info[0], info[1], allocated, reserved)


def profile_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profile's largest step: ``max_num_batched_tokens`` tokens spread evenly
    over up to ``max_num_seqs`` sequences, each shorter than ``max_model_len``."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    tokens = min(max_num_batched_tokens, num_seqs * (max_model_len - 1))
    base, extra = divmod(tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs) if base + (i < extra) > 0]


def measure(start: Snapshot, model, backend, spec: KVCacheSpec, kv_dtype, config, max_model_len: int, *, graphs: bool):
    """:class:`MemoryUse` of an engine whose weights loaded after ``start``: runs the profile steps on
    a temporary pool (freed before returning).

    With speculative decoding the second step is a verification of ``max_num_seqs`` sequences of
    ``k + 1`` tokens: every row's logits and the rejection sampler (with draft distributions for a
    draft model), run eagerly after the captured steps too; its peak counts as the graphs' share, or
    in the activations when steps run eagerly. Captured steps take a mixture-of-experts layer's dense
    path up to their largest shape (``prepare_static``, as ``DecodeGraphs`` sets it), so the profile
    does too."""
    device = config.device
    weights = devices.allocator_memory(device)[0] - start.allocated
    speculative = config.speculative_config
    q = 1 if speculative is None else speculative.num_speculative_tokens + 1
    if graphs:
        model.prepare_static(config.max_num_seqs * q)
    steps = [profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)]
    if graphs or speculative is not None:  # the largest uniform step: max_num_seqs sequences of q tokens
        steps.append([q] * config.max_num_seqs)
    peaks = _run_profile_steps(model, backend, spec, kv_dtype, config, steps, speculative)
    after = snapshot(device)
    return MemoryUse(
        total=start.total,
        available=start.free + start.reserved - start.allocated,
        weights=weights,
        activations=peaks[0] if graphs else max(peaks),
        graphs=peaks[1] if graphs else 0,
        non_torch=max(0, (start.free + start.reserved) - (after.free + after.reserved)),
    )


def _run_profile_steps(model, backend, spec, kv_dtype, config, steps: list[list[int]], speculative=None) -> list[int]:
    """Peak bytes allocated above the baseline during each step (one forward of prompts of these
    lengths, with its logits and sampling). With ``speculative``, the second step's sequences hold
    ``k`` proposed tokens each after a one-token prompt: every row has logits and is verified."""
    from ..models.base import MultimodalModel
    from .model_runner import ModelRunner
    from .page_manager import PageManager
    from .req_pool import ReqToTokenPool
    from .sampling_params import SamplingParams
    from .scheduler import Scheduler
    from .sequence import Sequence

    # Every row samples with every filter (min_p, top_k and top_p: on the CPU, and wherever torch draws,
    # top_k sorts the scores' keys): the peak holds what any step's sampling, eager or in a captured
    # decode step's draw, allocates.
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)
    device, size = config.device, config.page_size
    pages = max(sum(num_pages_for(n, size) for n in lengths) for lengths in steps)
    longest = max(max(lengths) for lengths in steps)
    kv_pool = make_kv_pool(spec, pages, size, kv_dtype, device)
    req_pool = ReqToTokenPool(max(map(len, steps)), num_pages_for(longest, size) * size, size, device)
    runner = ModelRunner(model, kv_pool, req_pool, backend)
    if speculative is not None:
        runner.verifier = _profile_verifier(speculative)
    multimodal = isinstance(model, MultimodalModel)
    peaks = []
    for step, lengths in enumerate(steps):
        verifying = speculative is not None and step == 1
        scheduler = Scheduler(PageManager(PageAllocator(pages), req_pool, False), len(lengths), sum(lengths))
        for i, n in enumerate(lengths):
            ids = [(7 * j + i) % 128 for j in range(n)]  # plain text ids (no image pads), varied for MoE routing
            prompt = ids[:1] if verifying else ids
            mm = model.multimodal_data(prompt, None, None) if multimodal else None
            scheduler.add(Sequence(-1 - i, prompt, params, token_ids=list(ids), multimodal=mm))
        scheduled = scheduler.schedule()
        assert sum(n for _, n in scheduled) == sum(lengths), "the profile step is one forward"
        for seq, n in scheduled if verifying else ():
            seq.num_draft_tokens = n - 1
        if not verifying:
            _compile_ahead(runner, scheduled, device)
        devices.reset_peak_memory(device)
        baseline = devices.allocator_memory(device)[0]
        runner.step(scheduled)
        devices.synchronize(device)
        peaks.append(devices.allocator_memory(device)[2] - baseline)
        for seq, _ in scheduled:
            scheduler.finish(seq, "abort")
    del runner, kv_pool, req_pool
    devices.reset_peak_memory(device)
    return peaks


def _compile_ahead(runner, scheduled: list, device: torch.device) -> None:
    """Compile the Triton kernels of a profile step in parallel before it runs
    (``kernels/triton/compile_ahead.py``; where that applies): its forward with no Triton kernel run,
    then its sampling over zero logits (the forward's are unset), nothing kept. Otherwise the measured
    step compiles them one after another as it meets them."""
    from ..kernels.triton.compile_ahead import compile_ahead

    with compile_ahead(device) as rehearsing:
        if rehearsing:
            want = runner.logit_rows(scheduled)
            logits = runner.forward(scheduled, want.rows)
            if logits is not None:
                runner.sampled(runner.start_sampling(want, torch.zeros_like(logits)))


def _profile_verifier(speculative):
    """The rejection sampler as a verification step runs it: with a draft model's distributions (one
    ``[k, V]`` tensor per sequence, as the proposer holds them) for ``draft_model``, point masses else."""
    from .spec_decode.rejection import verify

    def verifier(logits: torch.Tensor, seqs: list) -> dict:
        vocab = logits.shape[-1]
        drafts = [None] * len(seqs)
        if speculative.method == "draft_model":
            k = speculative.num_speculative_tokens
            drafts = [torch.full((k, vocab), 1 / vocab, device=logits.device) for _ in seqs]
        return verify(logits, seqs, drafts, frozenset())

    return verifier
