"""One mixture-of-experts layer for every family: stacked gated experts, routed by the model's router.

The experts are ``E`` gated MLPs stacked into two parameters, in ``F.linear`` layout:
``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``. A router (the
family's own: sigmoid top-k for Llama 4, grouped top-k for DeepSeek V3, ...) gives each token ``k``
expert ids and weights; the weights scale either the expert's output (the usual form) or its input
(``weight_on_input``, Llama 4).

Two ways to compute the same sum, chosen from the token count (a Python int, no sync):

* **dense** (``T <= DENSE_MAX_TOKENS``, decode steps): every expert runs on every token with a
  combine weight that is zero where the token did not pick it: three batched matmuls, no host sync,
  so a captured decode graph can contain it. It reads every expert once, as a decode batch that
  touches most experts does anyway.
* **grouped** (prefill): tokens are sorted by expert and each expert runs on its own tokens; the
  per-expert counts cost one host sync per layer.

Checkpoints store experts either stacked (``checkpoint_layout="stacked_in_out"``: one tensor per
projection ``[E, in, out]``, Llama 4) or one ``nn.Linear`` per expert and projection
(``"per_expert"``: shards ``(expert, "gate" | "up")`` and ``(expert, "down")``, DeepSeek V3).
"""

from __future__ import annotations

import torch
from torch import nn

from .activation import activation, gated
from .linear import copy_checked, new_parameter

DENSE_MAX_TOKENS = 16
CHECKPOINT_LAYOUTS = ("stacked_in_out", "per_expert")


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
    ):
        super().__init__()
        if checkpoint_layout not in CHECKPOINT_LAYOUTS:
            raise ValueError(f"expected checkpoint_layout in {CHECKPOINT_LAYOUTS}, got {checkpoint_layout!r}")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.act = activation(act)
        self.weight_on_input = weight_on_input
        self.checkpoint_layout = checkpoint_layout
        per_expert = checkpoint_layout == "per_expert"
        experts = range(num_experts)
        self.gate_up_proj = new_parameter(
            num_experts, 2 * intermediate_size, hidden_size, loader=self.weight_loader,
            shards=[(e, part) for e in experts for part in ("gate", "up")] if per_expert else None,
        )  # fmt: skip
        self.down_proj = new_parameter(
            num_experts, hidden_size, intermediate_size, loader=self.weight_loader,
            shards=[(e, "down") for e in experts] if per_expert else None,
        )  # fmt: skip

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str] | None = None) -> None:
        if shard is None:  # a stacked [E, in, out] tensor
            copy_checked(param.data, loaded.transpose(1, 2))
            return
        expert, part = shard
        inter = self.intermediate_size
        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}[part]
        copy_checked(param.data[expert, rows], loaded)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``topk_weights [T, k]`` (any float dtype), ``topk_ids [T, k]`` -> ``[T, H]`` in x's dtype."""
        if x.shape[0] <= DENSE_MAX_TOKENS:
            return self.forward_dense(x, topk_weights, topk_ids)
        return self.forward_grouped(x, topk_weights, topk_ids)

    def forward_dense(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by a combine matrix that is zero where not routed (no sync)."""
        combine = topk_weights.new_zeros((x.shape[0], self.num_experts))
        combine.scatter_(1, topk_ids, topk_weights)  # [T, E]
        combine = combine.t()[:, :, None]  # [E, T, 1]
        inputs = (x[None] * combine).to(x.dtype) if self.weight_on_input else x.expand(self.num_experts, -1, -1)
        hidden = gated(self.act, torch.bmm(inputs, self.gate_up_proj.transpose(1, 2)))  # [E, T, I]
        out = torch.bmm(hidden, self.down_proj.transpose(1, 2))  # [E, T, H]
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
                hidden = gated(self.act, inputs @ self.gate_up_proj[e].t())  # [n, I]
                y = hidden @ self.down_proj[e].t()  # [n, H]
                out.index_add_(0, tokens, y if self.weight_on_input else (y * weight).to(x.dtype))
            start += n
        return out
