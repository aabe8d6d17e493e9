"""Multi-head Latent Attention (DeepSeek V2/V3) over the engine's latent KV pool.

A layer caches one row per token, ``[c_kv | k_pe]`` (``kv_lora_rank + rope_dim``), and attends in
one of two forms, chosen once per forward in the engine's plan step
(the ``"mla"`` pool's plan, :func:`portattn.runtime.plan.plan_latent_attention`, read here as
``ctx.cache_plan``):

* **absorbed** (decodes: one new token per sequence, or the few of a speculative verification, one
  row per token): ``q_nope`` is multiplied into the latent space through the key half of
  ``kv_b_proj``, :func:`portattn.mla_decode`'s kernel (the backend's ``mla_decode``) attends to the
  latent rows, and its output leaves the latent space through the value half of ``kv_b_proj``;
* **expanded** (prefill and extend chunks): the latent rows of every key of the batch's sequences are
  gathered and expanded by ``kv_b_proj`` into per-head keys ``[k_nope | k_pe]`` and values, then
  attended with the backend's varlen op (causal, queries bottom-right aligned).

Both are exact rewrites of the same attention; the plan picks the cheaper one per sequence (a
batch that mixes decodes and prompt chunks runs each part in its form).

Under tensor parallelism the heads are split: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are
column-parallel by heads, ``o_proj`` row-parallel (the layer's one all-reduce); the low-rank
down-projections, their norms and the latent cache (one row per token, shared by all heads) are
replicated on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ...backends.base import AttentionSpec
from ...backends.cache import LatentKVCache
from ...backends.metadata import MLADecodeMetadata
from ...distributed.group import TPGroup, tp_or_single
from ...kv_quant import dequantize_kv
from ...runtime.context import ForwardContext
from ...runtime.plan import LatentAttentionPlan
from .fused import fused_ops
from .linear import ColumnParallelLinear, Linear, RowParallelLinear, project
from .norm import RMSNorm
from .rotary import PartialRotaryEmbedding

# The rope of q_pe and k_pe and the latent cache write in one launch where the backend has it
# (write_latent_rotary: the Triton backend over a cache of the model's dtype). False: the rope's torch code, then
# write_latent.
FUSED_ROTARY_WRITE = True
# kv_a_layernorm folded into that launch (its RMSNorm of the latent row computed before the row is stored): one
# launch a layer fewer. False: the norm's own launch first.
FOLD_LATENT_NORM = True
# On GPUs a one-token absorbed step leaves the latent space through fused_launch.expert_rows (each head's rows of
# kv_b_proj's value half streamed on the vector units) instead of a batched matmul of one row a head. Off until
# timed on a GPU.
ABSORBED_VALUE_ROWS = False
_LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


class MultiheadLatentAttention(nn.Module):
    """DeepSeek V3's attention; parameter names follow transformers' ``DeepseekV3Attention``.

    ``rotary`` (a module with ``apply(x, cos, sin)``) rotates ``q_pe`` and ``k_pe``; ``scale`` is
    the softmax scale (with YaRN's mscale folded in by the caller).
    """

    def __init__(self, config, layer_id: int, scale: float, *, tp: TPGroup | None = None):
        super().__init__()
        tp = tp_or_single(tp)
        heads = config.num_attention_heads
        self.num_heads = tp.split(heads, "num_attention_heads")  # this rank's
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        bias, hidden = config.attention_bias, config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, bias=False, tp=tp)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, bias=False, tp=tp)
        self.kv_a_proj_with_mqa = Linear(hidden, rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(rank, _LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(rank, heads * (self.nope_dim + self.v_dim), bias=False, tp=tp)
        self.kv_b_proj.quantizable = False  # its weight is absorbed into the attention (fp8_linear)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, tp=tp)
        self.scale = scale
        # What the engine's backend selection reads (the expanded form's shapes, this rank's heads).
        local = self.num_heads
        self.spec = AttentionSpec(layer_id, local, local, qk_dim, scale=scale, v_head_dim=self.v_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext, rotary, table) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; ``table``: ``rotary.table(positions, dtype)`` (:mod:`.decoder`)."""
        plan: LatentAttentionPlan = ctx.cache_plan
        num_tokens = x.shape[0]
        if self.q_lora_rank is None:
            q = project(self.q_proj, x)
        else:
            q = project(self.q_b_proj, self.q_a_layernorm(project(self.q_a_proj, x)))
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, Dn + Dr]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = project(self.kv_a_proj_with_mqa, x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cache: LatentKVCache = ctx.kv_cache(self.spec.layer_id)  # latent [num_pages, P, R + Dr], its scale
        slots = ctx.metadata.out_cache_loc
        rotated = normed = None
        fused = FUSED_ROTARY_WRITE and fused_ops(q_pe) is not None  # fused kernels on here, as for forward_rotary
        if fused and isinstance(rotary, PartialRotaryEmbedding):  # the backend's one launch, if it has one
            norm = self.kv_a_layernorm
            fold = FOLD_LATENT_NORM and norm.mode == "dtype"
            normed = None if fold else norm(c_kv)
            rotated = ctx.backend.write_latent_rotary(q_pe, c_kv if fold else normed, k_pe, *table, cache, slots,
                                                      interleave=rotary.interleave,
                                                      norm=(norm.weight, norm.eps) if fold else None)  # fmt: skip
        if rotated is None:
            c_kv = normed if normed is not None else self.kv_a_layernorm(c_kv)
            q_pe = rotary.apply(q_pe, *table)  # [T, H, Dr]
            k_pe = rotary.apply(k_pe[:, None, :], *table)[:, 0]  # [T, 1, Dr] -> [T, Dr]
            ctx.backend.write_latent(c_kv, k_pe, cache, slots)
        else:
            q_pe = rotated
        if plan.varlen is None:
            out = self._absorbed(q_nope, q_pe, cache, ctx, plan.decode)
        elif plan.decode is None:
            out = self._expanded(q_nope, q_pe, cache, ctx, plan)
        else:  # decodes absorbed, prefill/extend chunks expanded
            out = q_nope.new_empty((num_tokens, self.num_heads, self.v_dim))
            d, e = plan.decode_rows, plan.expand_rows
            out[d] = self._absorbed(q_nope[d], q_pe[d], cache, ctx, plan.decode)
            out[e] = self._expanded(q_nope[e], q_pe[e], cache, ctx, plan)
        return project(self.o_proj, out.flatten(1))  # [T, H * Dv] -> [T, hidden]

    def _kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)  # [H, Dn+Dv, R]
        return w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, Dn, R], [H, Dv, R]

    def _absorbed(self, q_nope, q_pe, cache: LatentKVCache, ctx: ForwardContext, metadata: MLADecodeMetadata):
        w_k, w_v = self._kv_b_halves()
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_k)  # [B, H, R]
        out = q_latent.new_empty(q_latent.shape)  # [B, H, R]
        ctx.backend.mla_decode(
            q_latent, q_pe.contiguous(), cache.latent, metadata, self.scale, out, kv_scale=cache.scale
        )
        ops = fused_ops(out) if ABSORBED_VALUE_ROWS and out.shape[0] == 1 else None
        if ops is not None:  # head h's row through w_v[h]: rows p -> head p % H
            return ops.expert_rows(out.view(-1, out.shape[-1]), None, w_v).view(out.shape[0], self.num_heads, -1)
        return torch.einsum("bhr,hvr->bhv", out, w_v)  # [B, H, Dv]

    def _expanded(self, q_nope, q_pe, cache: LatentKVCache, ctx: ForwardContext, plan: LatentAttentionPlan):
        latent = cache.latent
        rows = latent.view(-1, latent.shape[-1])[plan.key_slots]  # [K, R + Dr]
        if rows.dtype != q_nope.dtype:  # an fp8 cache: the rows it stands for, in the model's dtype
            rows = dequantize_kv(rows, cache.scale).to(q_nope.dtype)
        num_keys = rows.shape[0]
        kv = self.kv_b_proj(rows[:, : self.kv_lora_rank])  # [K, H * (Dn + Dv)]
        k_nope, v = kv.view(num_keys, self.num_heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = rows[:, None, self.kv_lora_rank :].expand(num_keys, self.num_heads, self.rope_dim)  # [K, H, Dr]
        k = torch.cat([k_nope, k_pe], dim=-1)  # [K, H, Dn + Dr]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, Dn + Dr]
        out = q.new_empty((q.shape[0], self.num_heads, self.v_dim))
        return ctx.backend.varlen_attention(q, k, v.contiguous(), plan.varlen, self.spec.params, out)  # [T, H, Dv]
