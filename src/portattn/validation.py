"""Checks of public inputs, shared by the ops, the MLA op and the vision encoder.

Every check raises ``ValueError("expected ..., got ...")`` through :func:`portattn.errors.expect`,
naming the argument, what was expected and what came.
"""

from __future__ import annotations

import itertools
import math

import torch

from .backends.base import AttentionParams
from .errors import expect

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when the current index is 0."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.accelerator.current_device_index() if a.type != "cpu" else None
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def check_tensor(name: str, t: object, dim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    expect(isinstance(t, torch.Tensor), f"{name} to be a torch.Tensor", type(t).__name__)
    expect(t.dim() == dim, f"{name} with {dim} dims", f"shape {tuple(t.shape)}")
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    expect(t.dtype in dtypes, f"{name} of dtype {names}", t.dtype)
    expect(same_device(t.device, device), f"{name} on {device}", t.device)


def check_head_groups(num_q_heads: int, num_kv_heads: int) -> None:
    """MHA, GQA and MQA: every KV head serves the same number of query heads."""
    expect(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"query heads divisible by KV heads ({num_kv_heads})",
        num_q_heads,
    )


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> list[int]:
    """Validate offsets and return the per-sequence lengths (host copy)."""
    expect(cu.numel() >= 1, f"{name} of shape [B + 1]", f"shape {tuple(cu.shape)}")
    values = cu.tolist()
    expect(values[0] == 0, f"{name}[0] == 0", values[0])
    lens = [b - a for a, b in itertools.pairwise(values)]
    bad = next((i for i, n in enumerate(lens) if n < 0), None)
    expect(
        bad is None,
        f"non-decreasing {name}",
        f"{name}[{bad}:{bad + 2}] = {values[bad : bad + 2]}" if bad is not None else "",
    )
    expect(values[-1] == total, f"{name}[-1] == {total} (tokens in the input)", values[-1])
    return lens


def attention_params(
    *,
    head_dim: int,
    num_q_heads: int,
    scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    attention_chunk_size: int | None,
    sinks: torch.Tensor | None,
    logit_softcap: float,
    device: torch.device,
) -> AttentionParams:
    expect(isinstance(window_left, int) and window_left >= -1, "window_left to be an int >= -1", window_left)
    expect(isinstance(window_right, int) and window_right >= -1, "window_right to be an int >= -1", window_right)
    if attention_chunk_size is not None:
        expect(
            isinstance(attention_chunk_size, int) and attention_chunk_size >= 1,
            "attention_chunk_size to be None or a positive int",
            attention_chunk_size,
        )
    expect(logit_softcap >= 0, "logit_softcap >= 0 (0 disables it)", logit_softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    expect(math.isfinite(scale) and scale > 0, "a positive finite scale", scale)
    if sinks is not None:
        check_tensor("sinks", sinks, 1, FLOAT_DTYPES, device)
        expect(
            sinks.shape[0] == num_q_heads, f"sinks of shape [{num_q_heads}] (one per query head)", tuple(sinks.shape)
        )
    return AttentionParams(
        scale=float(scale),
        causal=bool(causal),
        window_left=window_left,
        window_right=window_right,
        attention_chunk_size=attention_chunk_size,
        sinks=sinks,
        logit_softcap=float(logit_softcap),
    )


def check_out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, len(shape), (like.dtype,), like.device)
    expect(tuple(out.shape) == shape, f"out of shape {list(shape)}", list(out.shape))
    return out


def check_int(name: str, value: object, low: int) -> None:
    """An ``int`` (not a ``bool``) of at least ``low``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    expect(ok, f"{name} to be an int >= {low}", value)
