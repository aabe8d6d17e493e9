"""A draft model that proposes tokens, run by the engine's own machinery: its model, KV pool, page
allocator (with prefix caching when the engine has it), ``req_to_token`` rows and runner, with
captured graphs where the engine captures them.

Each target sequence that speculates has a shadow :class:`Sequence` here (same request id, the same
``token_ids`` list) whose ``num_computed`` counts the tokens whose draft K/V are valid. Proposing
``k`` tokens for a sequence of ``L`` tokens is ``k`` forwards: the first catches the draft up (the
tokens the target accepted since the draft last ran, or a new sequence's whole history, within the
engine's token budget), the next ``k - 1`` bring one drafted token each. After verification the
shadow keeps the K/V of the tokens the target kept (:meth:`DraftModelProposer.verified`).

In the steady state the draft lags by one token (the target rejected a proposal) or two (all were
accepted: the last proposal and the bonus token). A shadow one behind steps back one token (its K/V
are rewritten with the same values), so that the first forward of a step of such sequences is a
uniform step of 2 tokens each and replays a graph like the ``k - 1`` after it (1 token each).

Under tensor parallelism the draft runs unsharded on rank 0's device.
"""

from __future__ import annotations

import logging

import torch

from ...errors import fail
from ...models import loader
from ...models.base import MultimodalModel
from ...paging import PageAllocator
from ..config import EngineConfig
from ..graphs import batch_size_buckets
from ..model_runner import ModelRunner
from ..model_setup import model_kv_pool, select_attention_backend
from ..page_manager import PageManager
from ..req_pool import ReqToTokenPool
from ..sequence import Sequence, Status
from .config import SpeculativeConfig
from .rejection import SequencePrefix, sample_drafts

logger = logging.getLogger("portattn")


def check_vocabulary(target_vocab: int, draft_vocab: int, target_tokenizer, draft_tokenizer, path: str) -> None:
    """Refuse a draft whose vocabulary is not the target's (its size, and its tokenizer's entries)."""
    if draft_vocab != target_vocab:
        fail(
            f"a draft model with the target's vocabulary (vocab_size {target_vocab})",
            f"vocab_size {draft_vocab} in {path}",
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return
    mine, theirs = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if mine != theirs:
        by_id = {i: t for t, i in theirs.items()}
        token = next((t for t, i in sorted(mine.items(), key=lambda x: x[1]) if by_id.get(i) != t), None)
        where = f"token {token!r} is id {mine[token]} in the target, {theirs.get(token)} in the draft"
        fail("a draft model with the target's tokenizer", f"a different one in {path} ({where})")


def load_draft_model(
    config: SpeculativeConfig, engine_config: EngineConfig, target_vocab_size: int, target_tokenizer, max_model_len: int
):
    """The draft checkpoint's model (``config.model``, in the engine's dtype on its device), refused
    when its vocabulary or tokenizer is not the target's, when it holds fewer positions than
    ``max_model_len``, or when it takes images."""
    path = config.model
    hf_config = loader.load_config(path)
    text_config = getattr(hf_config, "text_config", None) or hf_config
    check_vocabulary(target_vocab_size, text_config.vocab_size, target_tokenizer, loader.load_tokenizer(path), path)
    positions = getattr(text_config, "max_position_embeddings", None)
    if positions is not None and positions < max_model_len and not engine_config.allow_long_max_model_len:
        fail(f"a draft model with max_position_embeddings >= max_model_len {max_model_len}", f"{positions} in {path}")
    model = loader.load_model(path, engine_config.dtype, engine_config.device, hf_config)
    if isinstance(model, MultimodalModel):
        fail("a text-only draft model", f"{type(model).__name__} in {path}")
    return model


class DraftModelProposer:
    """Proposals of a draft ``model`` (:func:`load_draft_model`) for the engine configured by
    ``engine_config``: the same dtype, device, page size, KV-cache dtype, backend choice, token budget
    and prefix caching; a pool of ``num_pages`` pages (as many tokens as the target's) and
    ``max_num_seqs`` request rows."""

    def __init__(
        self,
        config: SpeculativeConfig,
        model,
        engine_config: EngineConfig,
        *,
        max_model_len: int,
        num_pages: int,
        eos_token_ids: frozenset[int],
        capture_graphs: bool,
    ):
        path = config.model
        self.model = model
        self.k = config.num_speculative_tokens
        self.eos_token_ids = eos_token_ids
        self.budget = engine_config.max_num_batched_tokens  # tokens one catch-up forward may bring
        page_size = engine_config.page_size
        backend = select_attention_backend(self.model, engine_config)
        self.allocator = PageAllocator(num_pages)
        max_context = -(-max_model_len // page_size) * page_size
        self.req_pool = ReqToTokenPool(engine_config.max_num_seqs + 1, max_context, page_size, engine_config.device)
        scratch_row = self.req_pool.alloc()
        self.pages = PageManager(self.allocator, self.req_pool, engine_config.enable_prefix_caching)
        self.runner = ModelRunner(
            self.model,
            model_kv_pool(self.model, path, engine_config, num_pages + 1),
            self.req_pool,
            backend,
            eos_token_ids,
            scratch_row=scratch_row,
            scratch_page=num_pages,
            uniform_q_lens=(1, 2),
        )
        if capture_graphs:
            buckets = batch_size_buckets(engine_config.max_num_seqs)
            self.runner.enable_graphs(buckets, capture=True, lazy=engine_config.lazy_graph_capture).capture_all()
        self.shadows: dict[int, Sequence] = {}  # request id -> the draft's sequence
        logger.info("speculative decoding: draft model %s, %d pages, backend %s", path, num_pages, backend.name)

    # -- shadows ---------------------------------------------------------------------------------

    def _shadow(self, seq: Sequence) -> Sequence | None:
        """The draft's sequence for ``seq`` (admitted with a request row and its cached prefix), or None
        when no request row is free."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            if not self.req_pool.num_free:
                return None
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, token_ids=seq.token_ids)
            try:
                shadow.req_pool_idx = self.req_pool.alloc()
                shadow.status = Status.RUNNING
                self.shadows[seq.request_id] = shadow
                self.pages.match_prefix(shadow)
            except BaseException:
                self._drop(shadow)
                raise
        shadow.token_ids = seq.token_ids
        return shadow

    def _drop(self, shadow: Sequence) -> None:
        """Give back the shadow's pages and request row, then forget it: a shadow is forgotten only once
        it holds nothing, also when an exception arrives between two lines (a later drop completes it)."""
        self.pages.release_all(shadow)
        self.shadows.pop(shadow.request_id, None)

    def release(self, live: set[int]) -> None:
        """Drop the shadows of requests not in ``live`` (finished, aborted or preempted targets)."""
        for request_id in [r for r in self.shadows if r not in live]:
            self._drop(self.shadows[request_id])

    def verified(self, seq: Sequence) -> None:
        """After ``seq``'s verification: its shadow keeps the K/V of the tokens the target kept (the
        draft's tokens agree with the target's up to there), and indexes them in its prefix cache."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is not None:
            shadow.token_ids = seq.token_ids
            shadow.num_computed = min(shadow.num_computed, seq.num_computed)
            self.pages.commit(shadow)

    # -- proposing -------------------------------------------------------------------------------

    def _catch_up(self, seq: Sequence, k: int, budget: float) -> tuple[Sequence, int] | None:
        """The shadow and how many tokens it computes in the first forward (None: it cannot run now)."""
        shadow = self._shadow(seq)
        if shadow is None:
            return None
        size = self.pages.page_size
        lag = seq.num_tokens - shadow.num_computed
        back = shadow.num_computed - 1
        if lag == 1 and back >= 0 and back // size >= len(shadow.page_hashes):  # not a page the cache shares
            shadow.num_computed, lag = back, 2
        n = int(min(lag, budget))
        if n < 1:
            return None
        if not self.pages.reserve(shadow, shadow.num_computed + n + (k - 1 if n == lag else 0)):
            self._drop(shadow)  # the draft's pool is full: this sequence re-enters later
            return None
        return shadow, n

    @torch.inference_mode()
    def propose(self, requests: list[tuple[Sequence, int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """``(proposed tokens, their draft distributions [k, V] or None)`` for each ``(sequence, k)``: ``k``
        tokens, sampled as the request samples (``None``: greedy, a point mass), or none when the draft
        cannot run the sequence in this step (its catch-up does not fit the token budget or its pool)."""
        budget = self.budget if self.budget is not None else float("inf")
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(requests)
        first: list[tuple[Sequence, int]] = []
        drafting: list[tuple[int, Sequence, Sequence, int]] = []  # (index, target, shadow, k)
        for i, (seq, k) in enumerate(requests):
            step = self._catch_up(seq, k, budget)
            if step is None:
                continue
            shadow, n = step
            budget -= n
            first.append(step)
            if shadow.num_computed + n == seq.num_tokens:
                drafting.append((i, seq, shadow, k))
        if not first:
            return out
        rows, start = [], 0
        for shadow, n in first:
            start += n
            if shadow.num_computed + n == shadow.num_tokens:
                rows.append(start - 1)
        logits = self.runner.forward(first, rows)  # [len(drafting), V]
        for shadow, n in first:
            shadow.num_computed += n
        tokens = {i: [] for i, *_ in drafting}
        probs = {i: [] for i, *_ in drafting}
        base = {i: seq.num_tokens for i, seq, *_ in drafting}
        try:
            for j in range(max((k for *_, k in drafting), default=0)):
                if j:
                    active = [(i, seq, shadow, k) for i, seq, shadow, k in drafting if k > j]
                    step = [(shadow, 1) for _, _, shadow, _ in active]
                    logits = self.runner.forward(step, list(range(len(step))))  # [n, V]
                    for shadow, _ in step:
                        shadow.num_computed += 1
                    drafting = active
                views = [SequencePrefix(seq, seq.num_tokens) for _, seq, _, _ in drafting]
                ids, q = sample_drafts(logits, views, self.eos_token_ids)
                for row, ((i, seq, _, _), token) in enumerate(zip(drafting, ids.tolist())):
                    seq.token_ids.append(token)  # the next forward's input
                    tokens[i].append(token)
                    if q is not None and not seq.params.greedy:
                        probs[i].append(q[row])
        finally:  # the targets' token lists lose the drafted tokens again (the caller appends them)
            for i, length in base.items():
                del requests[i][0].token_ids[length:]
        for i in tokens:
            out[i] = (tokens[i], torch.stack(probs[i]) if probs[i] else None)
        return out
