"""The peers each case is compared with, run on the same numbers laid out contiguously.

* ``cudnn`` / ``flash``: ``torch.nn.functional.scaled_dot_product_attention`` pinned to one
  backend. Decode folds the query heads of a KV head into the query-length axis
  (``q [B, Hkv, G, D]``, no mask), which is exact for one query and lets every SDPA backend read
  each KV head once. Extends use a bottom-right causal mask.
* ``flex``: compiled FlexAttention on the contiguous K/V (paging through a block mask would add
  a gather the other peers do not pay), with ``enable_gqa`` and a block mask for causal /
  bottom-right causal / document (varlen) masks.
* ``flash_varlen``: torch's FlashAttention varlen entry point.
* ``sdpa_loop``: SDPA (default backend choice) once per sequence.

A peer that does not run on this build returns its error message instead of a callable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

Peer = Callable[[int], object] | str


def error_line(exc: Exception) -> str:
    """One line naming an exception, for a result table."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _try(fn: Callable[[int], object]) -> Peer:
    """``fn`` if one call succeeds, else the error message."""
    try:
        fn(0)
        return fn
    except Exception as exc:  # a peer missing on this build is reported, not fatal
        return error_line(exc)


def sdpa_peer(backend: str, qs, ks, vs, *, mode: str, scale: float) -> Peer:
    """``qs[i] [B, Hq, n, D]``, ``ks[i]`` / ``vs[i] [B, Hkv, L, D]``; mode decode / prefill / extend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def run(i: int):
        q, k, v = qs[i], ks[i], vs[i]
        with sdpa_kernel([which]):
            if mode == "decode":
                b, hq, _, d = q.shape
                hkv = k.shape[1]
                qf = q.view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]: G queries per KV head
                return F.scaled_dot_product_attention(qf, k, v, scale=scale)
            if mode == "prefill":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            mask = causal_lower_right(q.shape[2], k.shape[2])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    return _try(run)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_peer(qs, ks, vs, *, mode: str, scale: float, doc_ids: torch.Tensor | None = None) -> Peer:
    """FlexAttention on ``[B, H, L, D]`` tensors; ``doc_ids [L]`` gives a varlen document mask."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        q, k = qs[0], ks[0]
        n, num_keys = q.shape[2], k.shape[2]
        offset = num_keys - n
        if mode == "decode":
            block_mask = None
        elif mode == "varlen":
            block_mask = create_block_mask(
                lambda b, h, qi, ki: doc_ids[qi] == doc_ids[ki], None, None, n, num_keys, device=q.device
            )
        else:  # bottom-right causal (prefill: offset 0)
            block_mask = create_block_mask(
                lambda b, h, qi, ki: ki <= qi + offset, None, None, n, num_keys, device=q.device
            )
        flex = _compiled_flex()
    except Exception as exc:
        return error_line(exc)
    return _try(lambda i: flex(qs[i], ks[i], vs[i], block_mask=block_mask, scale=scale, enable_gqa=True))


def flash_varlen_peer(qs, ks, vs, cu, max_len: int, *, scale: float) -> Peer:
    """``qs[i] [T, H, D]`` packed; ``cu [B + 1]`` int32."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        return _try(lambda i: varlen_attn(qs[i], ks[i], vs[i], cu, cu, max_len, max_len, scale=scale))
    except ImportError:
        pass

    def run(i: int):
        return torch.ops.aten._flash_attention_forward(
            qs[i], ks[i], vs[i], cu, cu, max_len, max_len, 0.0, False, False, scale=scale
        )[0]

    return _try(run)


def sdpa_loop_peer(qs, ks, vs, bounds: list[tuple[int, int]], *, scale: float) -> Peer:
    """SDPA once per sequence; ``bounds`` are (start, end) rows of the packed ``[T, H, D]`` tensors.

    Each sequence is laid out as a contiguous 4-D ``[1, H, n, D]`` tensor before timing: SDPA's fused
    kernels take only 4-D inputs, and 3-D or transposed views send it to its slow math path.
    """
    per_seq = [
        [tuple(t[a:b].transpose(0, 1).contiguous()[None] for t in (q, k, v)) for a, b in bounds]
        for q, k, v in zip(qs, ks, vs)
    ]

    def run(i: int):
        return [F.scaled_dot_product_attention(q, k, v, scale=scale) for q, k, v in per_seq[i]]

    return _try(run)
