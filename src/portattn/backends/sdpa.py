"""``sdpa``: torch's scaled_dot_product_attention once per sequence, for varlen (encoder) attention.

A familiar baseline for vision encoders: whatever SDPA kernel PyTorch picks on the device (flash,
memory-efficient, cuDNN, math). It has no sliding window, sinks or softcap; asking for them raises
:class:`~portattn.UnsupportedFeatureError` at selection time, naming the backends that have them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import key_range, query_positions, range_mask
from .base import AttentionBackend, AttentionParams, Capabilities
from .metadata import VarlenMetadata


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    priority = 5
    capabilities = Capabilities(
        ops=frozenset({"varlen_attention"}),
        features=frozenset({"non_causal", "dv_ne_d"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64}),
    )

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: VarlenMetadata,
        params: AttentionParams,
        out: torch.Tensor,
    ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        q_start = k_start = 0
        for n, num_keys in zip(metadata.q_lens, metadata.k_lens):
            if n > 0:
                # 4-D inputs: the fused SDPA kernels (flash, memory-efficient) take only those.
                qs = q[q_start : q_start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
                ks = k[k_start : k_start + num_keys].transpose(0, 1)[None]  # [1, Hkv, L, D]
                vs = v[k_start : k_start + num_keys].transpose(0, 1)[None]  # [1, Hkv, L, Dv]
                mask = None
                if params.causal and n != num_keys:
                    # SDPA's is_causal is top-left aligned; portattn's queries are bottom-right aligned.
                    lo, hi = key_range(query_positions(n, num_keys, q.device), causal=True)
                    mask = range_mask(lo, hi, torch.arange(num_keys, device=q.device))  # [n, L]
                res = F.scaled_dot_product_attention(
                    qs,
                    ks,
                    vs,
                    attn_mask=mask,
                    is_causal=params.causal and mask is None,
                    scale=params.scale,
                    enable_gqa=gqa,
                )[0]  # [Hq, n, Dv]
                if mask is not None:  # rows that see no key: NaN from some SDPA kernels, else garbage
                    res = torch.where(mask.any(-1)[None, :, None], res, 0.0)
                out[q_start : q_start + n] = res.transpose(0, 1)
            q_start += n
            k_start += num_keys
        return out
