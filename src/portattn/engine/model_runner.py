"""Runs one scheduled step: ForwardBatch -> plan -> model -> logits -> sampled tokens.

The plan step (:meth:`ModelRunner.plan`) makes everything the forward reads before the model runs,
and is the only place a step syncs with the device: the backend's paged metadata, the extra plan the
model's KV cache kind needs (the latent-attention plan of an ``"mla"`` cache), and for multimodal
models the vision encoder's plan and the image embeddings the step needs.
"""

from __future__ import annotations

import torch

from ..backends.base import AttentionBackend
from ..models.base import MultimodalModel
from ..runtime.context import ForwardContext
from ..runtime.kv_cache import KVPool
from ..runtime.plan import plan_for_cache
from .forward_batch import ForwardBatch
from .multimodal import build_multimodal_batch
from .req_pool import ReqToTokenPool
from .sampler import sample
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, req_pool: ReqToTokenPool, backend: AttentionBackend):
        self.model = model
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.backend = backend
        layers = model.attention_layers()
        chunks = {layer.attention_chunk_size for layer in layers} - {None}
        if len(chunks) > 1:
            raise ValueError(f"expected one attention_chunk_size across layers, got {sorted(chunks)}")
        self.attention_chunk_size = chunks.pop() if chunks else None
        self.num_heads = max(layer.num_heads for layer in layers)  # sizes split-KV launches
        self.multimodal = isinstance(model, MultimodalModel)

    def plan(self, scheduled: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, ForwardContext]:
        """Everything the forward reads, made before the model runs (every host sync of the step)."""
        batch = ForwardBatch.build(
            scheduled, self.req_pool.req_to_token, self.kv_pool.page_size, self.attention_chunk_size
        )
        metadata = self.backend.plan(batch, num_heads=self.num_heads)
        latent = plan_for_cache(self.kv_pool.spec, self.backend, metadata, num_heads=self.num_heads)
        multimodal = None
        if self.multimodal:
            multimodal = build_multimodal_batch(self.model, scheduled, batch.input_ids.device)  # None: no images
        return batch, ForwardContext(self.backend, metadata, self.kv_pool, latent, multimodal)

    @torch.inference_mode()
    def step(self, scheduled: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        """Run the forward; returns the token sampled for each sequence whose tokens are now all computed."""
        batch, ctx = self.plan(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, ctx)

        # Rows of `hidden` that need logits: the last token of each finishing sequence, and the
        # prompt positions of sequences that asked for prompt logits.
        sample_rows, sampling, prompt_rows = [], [], []
        start = 0
        for seq, n in scheduled:
            if seq.params.return_prompt_logits:
                first = max(seq.num_computed, seq.num_prompt_logits)
                last = min(seq.num_computed + n, seq.num_prompt_tokens)
                if first < last:
                    prompt_rows.append((seq, start + first - seq.num_computed, last - first))
            if seq.num_computed + n == seq.num_tokens:
                sample_rows.append(start + n - 1)
                sampling.append(seq)
            start += n
        if not sample_rows and not prompt_rows:
            return {}
        rows = sample_rows + [r for _, first, count in prompt_rows for r in range(first, first + count)]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]).float()  # [N, V]
        offset = len(sample_rows)
        for seq, _, count in prompt_rows:
            seq.prompt_logits.append(logits[offset : offset + count].cpu())
            offset += count
        sample_logits = logits[: len(sample_rows)]
        for i, seq in enumerate(sampling):
            if seq.params.return_logits:
                seq.logits.append(sample_logits[i].cpu())
        tokens = sample(sample_logits, [s.params for s in sampling], [s.generator for s in sampling])
        return dict(zip(sampling, tokens))
