"""One mixture-of-experts layer for every family: stacked gated experts, routed by the model's router.

The experts are ``E`` gated MLPs stacked into two parameters, in ``F.linear`` layout:
``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``. A router (the
family's own: sigmoid top-k for Llama 4, grouped top-k for DeepSeek V3, ...) gives each token ``k``
expert ids and weights; the weights scale either the expert's output (the usual form) or its input
(``weight_on_input``, Llama 4).

Three ways to compute the same sum, chosen from the token count (a Python int, no sync):

* **routed** (on GPUs, plain gated experts of the rows' 16-bit dtype, up to ``EXPERT_TOKENS_BLOCK``
  tokens): with fewer (token, expert) pairs than experts each pair runs through its expert's rows
  alone (``fused_launch.expert_rows``: a batch-1 decode step reads its ``k`` experts instead of all
  of them); with more, each expert runs on the tokens that chose it (``fused_launch.expert_tokens``:
  an expert read once, one no token chose not at all, the routing weights applied inside). Two
  launches, no sync.
* **dense** (``T <= dense_max_tokens``, by default ``DENSE_MAX_TOKENS``; an engine that captures
  steps raises it to its largest captured step through ``CausalLM.prepare_static``): every expert
  runs on every token with a combine weight that is zero where the token did not pick it: three
  batched matmuls, no host sync, so a captured decode graph can contain it. It reads every expert
  once, as a decode batch that touches most experts does anyway.
* **grouped** (prefill): tokens are sorted by expert and each expert runs on its own tokens; the
  per-expert counts cost one host sync per layer.

Checkpoints store experts stacked (``checkpoint_layout="stacked_in_out"``: one tensor per
projection ``[E, in, out]``, Llama 4, gpt-oss), one ``nn.Linear`` per expert and projection
(``"per_expert"``: shards ``(expert, "gate" | "up")`` and ``(expert, "down")``, DeepSeek V3), or
stacked in ``F.linear`` layout and MXFP4-quantized (``"mxfp4"``: shards ``"blocks"`` and ``"scales"``
per projection, dequantized at load time by :mod:`.quant`; gpt-oss).

Options for families whose experts differ from the plain gated MLP (gpt-oss): ``bias`` adds
``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]``; ``gate_up_act`` replaces
``act(gate) * up`` by any function of the whole ``gate_up [..., 2I] -> [..., I]``, and
``gate_up_interleaved`` says that the checkpoint's gate and up rows alternate (``g0, u0, g1, u1, ...``)
instead of coming in two halves. The parameter keeps the checkpoint's layout, or alternating rows for
plain gated experts with ``EXPERTS_INTERLEAVED`` (the loader then writes each half's rows strided).

Tensor parallelism is tensor-parallel *inside* every expert (not expert-parallel): rank ``r`` holds
its ``I / size`` share of every expert's intermediate dim (gate/up column-parallel, down
row-parallel) and returns its partial sum, which the model all-reduces once, together with the
shared expert's. Every rank then does the same share of work whatever the router picks, and no
tokens move between ranks (an expert-parallel split would leave the rank of a popular expert
doing its whole load while the others wait, and needs a token exchange around the experts).
With interleaved gate/up rows a rank's share is one run of ``2I / size`` rows; the gate/up bias is
sharded like its rows, the down bias is added by rank 0 alone (the other ranks hold zeros), so the
all-reduced sum has it once. MXFP4 experts: gate/up rows are read as slices; the down projection's
columns too when a rank's share starts and ends on groups of 32 values, otherwise each rank reads
the whole quantized tensor (a quarter of its bfloat16 size) and keeps its columns.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from ...distributed.group import TPGroup, tp_or_single
from ...errors import expect
from .activation import activation, gated
from .fused import fused_ops
from .linear import Linear, as_tensor, copy_checked, new_parameter, shard_of
from .quant import GROUP_SIZE, MXFP4Pairs

DENSE_MAX_TOKENS = 16
# Steps of fewer routed pairs than experts through the routed experts alone on GPUs (False: the dense path).
ROUTED_EXPERTS = True
# The experts' gate and up rows alternating in gate_up_proj (g0, u0, g1, u1, ...) whatever the checkpoint's
# layout, as the gated MLP keeps them (mlp.GATE_UP_INTERLEAVED): a one-row program of the routed path then
# streams one run of rows. Off: [gate; up] halves unless the checkpoint interleaves them (gpt-oss).
EXPERTS_INTERLEAVED = True
# Steps through expert_rows combine each token's experts in the down projection's launch (the routing weight and
# the sum over its top_k pairs); off: the launch stores each pair's row and torch weighs and sums them.
COMBINE_IN_KERNEL = True
CHECKPOINT_LAYOUTS = ("stacked_in_out", "per_expert", "mxfp4")
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def per_expert_checkpoint_name(name: str) -> tuple[str, tuple[int, str]] | None:
    """A ``"per_expert"`` checkpoint tensor ``....experts.{e}.{gate,up,down}_proj.weight`` -> the stacked
    parameter it loads into and its shard ``(e, part)`` (for a model's ``checkpoint_name``); else None."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, index, part = match.groups()
    return f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}", (int(index), part)


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        *,
        weight_on_input: bool = False,
        checkpoint_layout: str = "per_expert",
        bias: bool = False,
        gate_up_act: Callable[[torch.Tensor], torch.Tensor] | None = None,
        gate_up_interleaved: bool = False,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        if checkpoint_layout not in CHECKPOINT_LAYOUTS:
            raise ValueError(f"expected checkpoint_layout in {CHECKPOINT_LAYOUTS}, got {checkpoint_layout!r}")
        if bias and weight_on_input:  # the dense path would add every unrouted expert's bias
            raise ValueError("expected expert biases only with weights on the output, got weight_on_input=True")
        if checkpoint_layout == "mxfp4" and not gate_up_interleaved:
            raise ValueError("expected MXFP4 experts with interleaved gate/up rows (gpt-oss's), got two halves")
        self.tp = tp = tp_or_single(tp)
        # the checkpoint's layout, and the parameter's (alternating also where EXPERTS_INTERLEAVED asks)
        self.checkpoint_interleaved = gate_up_interleaved
        self.gate_up_interleaved = gate_up_interleaved or (EXPERTS_INTERLEAVED and gate_up_act is None)
        self.full_intermediate_size = intermediate_size
        intermediate_size = tp.split(intermediate_size, "the experts' intermediate size")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.act_name = activation(act).name if gate_up_act is None else None  # the routed path's activation
        if gate_up_act is None:
            gate_up_act = functools.partial(gated, activation(act), interleaved=self.gate_up_interleaved)
        self.gate_up_act = gate_up_act
        self.dense_max_tokens = DENSE_MAX_TOKENS
        self.weight_on_input = weight_on_input
        self.checkpoint_layout = checkpoint_layout
        experts = range(num_experts)
        gate_up_shards = down_shards = None
        if checkpoint_layout == "per_expert":
            gate_up_shards = [(e, part) for e in experts for part in ("gate", "up")]
            down_shards = [(e, "down") for e in experts]
        elif checkpoint_layout == "mxfp4":
            gate_up_shards = down_shards = MXFP4Pairs.PARTS
            self._mxfp4 = MXFP4Pairs()
        self.gate_up_proj = new_parameter(
            num_experts, 2 * intermediate_size, hidden_size, loader=self.weight_loader, shards=gate_up_shards
        )
        self.down_proj = new_parameter(
            num_experts, hidden_size, intermediate_size, loader=self.weight_loader, shards=down_shards
        )
        bias_loader = self.bias_loader
        self.gate_up_proj_bias = new_parameter(num_experts, 2 * intermediate_size, loader=bias_loader) if bias else None
        self.down_proj_bias = new_parameter(num_experts, hidden_size, loader=bias_loader) if bias else None

    def _gate_up_rows(self, loaded, full_shape: list[int], dim: int) -> list[tuple[slice, object]]:
        """``(rows of the parameter, part of loaded)`` for this rank's gate/up rows along ``dim``."""
        inter, full = self.intermediate_size, self.full_intermediate_size
        first = self.tp.rank * inter
        if self.checkpoint_interleaved:  # one run of 2 * inter rows
            return [(slice(None), shard_of(loaded, full_shape, dim, 2 * first, 2 * inter))]
        gate = shard_of(loaded, full_shape, dim, first, inter)  # the first I rows, then the last I
        up = shard_of(loaded, full_shape, dim, full + first, inter)
        return [(self._part_rows("gate"), gate), (self._part_rows("up"), up)]

    def _part_rows(self, part: str) -> slice:
        """The parameter's rows of this rank's gate or up half: alternating, or two halves."""
        if self.gate_up_interleaved:
            return slice(0, None, 2) if part == "gate" else slice(1, None, 2)
        inter = self.intermediate_size
        return slice(0, inter) if part == "gate" else slice(inter, 2 * inter)

    def bias_loader(self, param: nn.Parameter, loaded) -> None:
        if param is self.down_proj_bias:  # [E, H]: added once, by rank 0
            if self.tp.rank == 0:
                copy_checked(param.data, loaded)
            else:
                shard_of(loaded, list(param.shape), 0, 0, param.shape[0])  # the shape is still checked
                param.data.zero_()
            return
        for rows, part in self._gate_up_rows(loaded, [self.num_experts, 2 * self.full_intermediate_size], 1):
            copy_checked(param.data[:, rows], as_tensor(part))

    def weight_loader(self, param: nn.Parameter, loaded, shard: object = None) -> None:
        inter, full = self.intermediate_size, self.full_intermediate_size
        experts, hidden = self.num_experts, self.down_proj.shape[1]
        first = self.tp.rank * inter  # this rank's intermediate columns [first, first + inter)
        if shard is None:  # a stacked [E, in, out] tensor
            if param is self.gate_up_proj:  # [E, H, 2I]
                for rows, part in self._gate_up_rows(loaded, [experts, hidden, 2 * full], 2):
                    copy_checked(param.data[:, rows], as_tensor(part).transpose(1, 2))
            else:  # [E, I, H]
                part = shard_of(loaded, [experts, full, hidden], 1, first, inter)
                copy_checked(param.data, as_tensor(part).transpose(1, 2))
            return
        if self.checkpoint_layout == "mxfp4":  # "blocks" [E, out, in/32, 16] or "scales" [E, out, in/32]
            self._load_mxfp4(param, shard, loaded)
            return
        expert, part = shard
        if part == "down":  # [H, I]
            copy_checked(param.data[expert], shard_of(loaded, [hidden, full], 1, first, inter))
            return
        rows = self._part_rows(part)  # gate or up: [I, H]
        copy_checked(param.data[expert, rows], shard_of(loaded, [full, hidden], 0, first, inter))

    def _load_mxfp4(self, param: nn.Parameter, part: str, loaded) -> None:
        """One half of an MXFP4 matrix; kept (read) until its pair arrives, then dequantized."""
        inter, full, tp = self.intermediate_size, self.full_intermediate_size, self.tp
        shape = list(loaded.shape)
        if tp.size == 1:  # the whole matrix: MXFP4Pairs checks its shape
            self._mxfp4.add(param, part, as_tensor(loaded))
        elif param is self.gate_up_proj:  # rows: interleaved gate/up, this rank's run of 2 * inter
            expect(len(shape) >= 3 and shape[1] == 2 * full, f"MXFP4 gate_up_proj with {2 * full} rows", shape)
            self._mxfp4.add(param, part, as_tensor(shard_of(loaded, shape, 1, 2 * tp.rank * inter, 2 * inter)))
        else:
            expect(len(shape) >= 3 and shape[2] * GROUP_SIZE == full, f"MXFP4 down_proj with {full} columns", shape)
            if (tp.rank * inter) % GROUP_SIZE == 0 and inter % GROUP_SIZE == 0:  # whole groups of columns
                groups = inter // GROUP_SIZE
                self._mxfp4.add(param, part, as_tensor(shard_of(loaded, shape, 2, tp.rank * groups, groups)))
            else:  # this rank's columns cut groups of 32: dequantized whole, then narrowed
                self._mxfp4.add(param, part, as_tensor(loaded), columns=(tp.rank * inter, inter))

    def prepare_static(self, max_tokens: int) -> None:
        """Take the sync-free dense path for up to ``max_tokens`` tokens (a captured step's)."""
        self.dense_max_tokens = max(self.dense_max_tokens, max_tokens)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``topk_weights [T, k]`` (any float dtype), ``topk_ids [T, k]`` -> ``[T, H]`` in x's dtype
        (under tensor parallelism: this rank's partial sum, to be all-reduced by the caller)."""
        ops = self._routed_ops(x, topk_ids)
        if ops is not None:
            return self.forward_routed(x, topk_weights, topk_ids, ops)
        if x.shape[0] <= self.dense_max_tokens:
            return self.forward_dense(x, topk_weights, topk_ids)
        return self.forward_grouped(x, topk_weights, topk_ids)

    def _routed_ops(self, x: torch.Tensor, topk_ids: torch.Tensor):
        """The fused launchers when the step takes :meth:`forward_routed`: plain gated experts (the
        named activation, no biases) of x's dtype, float16 or bfloat16, on a GPU, and fewer routed
        pairs than experts or at most one token block of ``expert_tokens``; else ``None``."""
        ops = fused_ops(x)
        if (
            ops is None
            or not ROUTED_EXPERTS
            or (topk_ids.numel() >= self.num_experts and x.shape[0] > ops.EXPERT_TOKENS_BLOCK)
            or self.act_name is None
            or self.gate_up_proj_bias is not None
            or self.down_proj_bias is not None
            or x.dtype not in (torch.float16, torch.bfloat16)
            or self.gate_up_proj.dtype != x.dtype
        ):
            return None
        return ops

    def forward_routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, ops) -> torch.Tensor:
        """Each (token, expert) pair through its expert's rows alone (``ops.expert_rows``: the gate/up
        with the activation, then the down projection) where the step has fewer pairs than experts,
        else each expert on the tokens that chose it (``ops.expert_tokens``); weighted and summed as
        :meth:`forward_dense` rounds it (no sync), by ``expert_rows``'s down projection itself with
        ``COMBINE_IN_KERNEL``."""
        tokens, top_k = topk_ids.shape
        if topk_ids.numel() >= self.num_experts:
            ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
            scale_input = weights if self.weight_on_input else None
            h = ops.expert_tokens(x, ids, self.gate_up_proj, act=self.act_name, interleaved=self.gate_up_interleaved,
                                  scale=scale_input, scale_input=self.weight_on_input)  # fmt: skip
            out = ops.expert_tokens(h, ids, self.down_proj, scale=None if self.weight_on_input else weights)
            out = out.view(tokens, top_k, -1)
            return out[:, 0] if top_k == 1 else out.sum(dim=1)
        inputs = x[:, None, :].expand(-1, top_k, -1).flatten(0, 1)  # [T * k, H]: x itself at one expert a token
        ids = topk_ids.flatten().contiguous()  # a [T, 1] slice flattens to a strided view
        # weight_on_input: each pair's input scaled by its weight in the gate/up launch (rounded as the torch code's)
        scale = topk_weights.reshape(-1, 1).contiguous() if self.weight_on_input else None
        h = ops.expert_rows(inputs, ids, self.gate_up_proj, act=self.act_name, interleaved=self.gate_up_interleaved,
                            scale=scale, scale_input=self.weight_on_input)  # fmt: skip
        if COMBINE_IN_KERNEL:
            scale = None if self.weight_on_input else topk_weights.contiguous()
            return ops.expert_rows(h, ids, self.down_proj, top_k=top_k, scale=scale)
        out = ops.expert_rows(h, ids, self.down_proj).view(tokens, top_k, -1)  # [T, k, H]
        if not self.weight_on_input:
            out = (out * topk_weights[:, :, None]).to(x.dtype)
        return out[:, 0] if top_k == 1 else out.sum(dim=1)  # one expert a token: no sum to launch

    def forward_dense(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by a combine matrix that is zero where not routed (no sync)."""
        combine = topk_weights.new_zeros((x.shape[0], self.num_experts))
        combine.scatter_(1, topk_ids, topk_weights)  # [T, E]
        combine = combine.t()[:, :, None]  # [E, T, 1]
        inputs = (x[None] * combine).to(x.dtype) if self.weight_on_input else x.expand(self.num_experts, -1, -1)
        gate_up = torch.bmm(inputs, self.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[:, None, :]
        out = torch.bmm(self.gate_up_act(gate_up), self.down_proj.transpose(1, 2))  # [E, T, H]
        if self.down_proj_bias is not None:
            out = out + self.down_proj_bias[:, None, :]
        if not self.weight_on_input:
            out = (out * combine).to(x.dtype)
        return out.sum(dim=0)  # [T, H]

    def forward_grouped(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each expert on the tokens that chose it (one host sync for the per-expert counts)."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()  # [T * k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        flat_weights = topk_weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                picks = order[start : start + n]  # [n] indices into [T * k]
                tokens = picks // top_k
                weight = flat_weights[picks, None]  # [n, 1]
                inputs = (x[tokens] * weight).to(x.dtype) if self.weight_on_input else x[tokens]
                gate_up = inputs @ self.gate_up_proj[e].t()  # [n, 2I]
                if self.gate_up_proj_bias is not None:
                    gate_up = gate_up + self.gate_up_proj_bias[e]
                y = self.gate_up_act(gate_up) @ self.down_proj[e].t()  # [n, H]
                if self.down_proj_bias is not None:
                    y = y + self.down_proj_bias[e]
                out.index_add_(0, tokens, y if self.weight_on_input else (y * weight).to(x.dtype))
            start += n
        return out


class SoftmaxTopKMoE(nn.Module):
    """Experts routed by a softmax over all router logits (``gate``, no bias, replicated under tensor
    parallelism): the ``top_k`` largest probabilities, renormalised to sum 1 with ``normalize``, weigh
    the chosen experts' outputs (Mixtral, Qwen3-MoE). ``weights_in_float32``: the weights stay float32
    (Mixtral); else they are rounded to the model's dtype first (Qwen3-MoE). Returns the all-reduced sum."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        act: str,
        *,
        normalize: bool,
        weights_in_float32: bool,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        expect(1 <= top_k <= num_experts, f"num_experts_per_tok in [1, num_experts {num_experts}]", top_k)
        self.tp = tp_or_single(tp)
        self.top_k, self.normalize, self.weights_in_float32 = top_k, normalize, weights_in_float32
        self.gate = Linear(hidden_size, num_experts)
        self.gate.quantizable = False  # the router keeps the model's dtype (fp8_linear)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, act, checkpoint_layout="per_expert", tp=tp)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for ``x [T, H]`` (under tensor parallelism: this rank's part)."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(logits.dtype)
        return self.experts(x, weights, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.routed(x))
