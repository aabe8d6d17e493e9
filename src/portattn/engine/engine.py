"""The engine core: model, KV pool, scheduler and runner, advanced one step at a time."""

from __future__ import annotations

import itertools
import logging

import torch

from ..backends.base import Request
from ..backends.registry import select_backend
from ..models import loader
from ..paging import PageAllocator, num_pages_for
from ..runtime.kv_cache import make_kv_pool
from ..runtime.multimodal import MultimodalData
from .config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from .model_runner import ModelRunner
from .page_manager import PageManager
from .req_pool import ReqToTokenPool
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

logger = logging.getLogger("portattn")


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.hf_config = loader.load_config(config.model)
        self.model = loader.load_model(
            config.model, config.dtype, config.device, self.hf_config, config.mm_attention_backend
        )
        self.tokenizer = loader.load_tokenizer(config.model)
        self.eos_token_ids = loader.eos_token_ids(config.model, self.hf_config)
        text_config = getattr(self.hf_config, "text_config", None) or self.hf_config
        self.vocab_size = text_config.vocab_size

        layers = self.model.attention_layers()
        features = frozenset().union(*(layer.features for layer in layers))
        first, *others = self.model.attention_ops
        request = Request(first, config.device.type, config.dtype, layers[0].head_dim, features, frozenset(others))
        self.backend = select_backend("attention", config.attention_backend, request)

        page_size = config.page_size
        spec = self.model.kv_cache_spec()
        max_len = config.max_model_len or getattr(text_config, "max_position_embeddings", None) or 8192
        num_pages = config.num_pages
        if num_pages is None:
            budget = config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            num_pages = min(
                budget // spec.bytes_per_page(page_size, config.dtype),
                config.max_num_seqs * num_pages_for(max_len, page_size),
            )
            if num_pages < 1:
                raise ValueError(f"expected kv_cache_memory to hold at least one page, got {budget} bytes")
        self.max_len = min(max_len, num_pages * page_size)
        self.kv_pool = make_kv_pool(spec, num_pages, page_size, config.dtype, config.device)
        self.allocator = PageAllocator(num_pages)
        self.req_pool = ReqToTokenPool(
            config.max_num_seqs, num_pages_for(self.max_len, page_size) * page_size, page_size, config.device
        )
        self.pages = PageManager(self.allocator, self.req_pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pages, config.max_num_seqs, config.chunked_prefill_size)
        self.runner = ModelRunner(self.model, self.kv_pool, self.req_pool, self.backend)
        self._ids = itertools.count()
        self.requests: dict[int, Sequence] = {}
        logger.info(
            "engine: %d pages of %d tokens, max_len %d, backend %s",
            num_pages,
            page_size,
            self.max_len,
            self.backend.name,
        )

    def add_request(
        self, token_ids: list[int], params: SamplingParams, multimodal: MultimodalData | None = None
    ) -> Sequence:
        self.check_prompt(token_ids)
        generator = None
        if not params.greedy and params.seed is not None:
            generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        seq = Sequence(next(self._ids), list(token_ids), params, generator, multimodal=multimodal)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("expected a prompt of at least one token, got an empty prompt")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"expected token ids in [0, {self.vocab_size}), got {token_ids[:8]}...")
        if len(token_ids) >= self.max_len:
            raise ValueError(f"expected a prompt shorter than max_len {self.max_len}, got {len(token_ids)} tokens")

    def abort(self, request_id: int) -> None:
        """Stop an unfinished request now; its pages and request slot go back to the pools."""
        if request_id not in self.requests:
            raise ValueError(f"expected the id of an unfinished request, got {request_id}")
        self.scheduler.finish(self.requests.pop(request_id), "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward; returns the sequences that finished in it."""
        scheduled = self.scheduler.schedule()
        sampled = self.runner.step(scheduled)
        for seq, n in scheduled:
            seq.num_computed += n
            self.pages.commit(seq)
        finished = []
        for seq, token in sampled.items():
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            return "stop"
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_len:
            return "length"
        return None
