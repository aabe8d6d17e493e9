"""Bad input raises ValueError saying what was expected and what came."""

from __future__ import annotations

import pytest
import torch

import portattn
from portattn.testing import cu_seqlens, make_paged_case


def paged_inputs():
    case = make_paged_case([1, 3], [5, 3], page_size=2, dtype=torch.float32)
    return case.inputs()


def _set(**changes):
    def mutate(args, kwargs):
        for name, value in changes.items():
            (kwargs if name in kwargs or name not in args else args)[name] = value(args) if callable(value) else value

    return mutate


I32 = torch.int32
PAGED_CASES = [
    ("q-type", _set(q=[1.0]), "expected q to be a torch.Tensor, got list"),
    ("q-dims", _set(q=lambda a: a["q"][0]), "expected q with 3 dims, got shape"),
    ("q-dtype", _set(q=lambda a: a["q"].int()), "expected q of dtype float16 or bfloat16 or float32 or float64, got"),
    (
        "k-dtype",
        _set(k_cache=lambda a: a["k_cache"].half()),
        "expected k_cache of dtype float32 or float8_e4m3fn or float8_e5m2, got torch.float16",
    ),
    ("k-device", _set(k_cache=lambda a: a["k_cache"].to("meta")), "expected k_cache on cpu, got meta"),
    ("k-dims", _set(k_cache=lambda a: a["k_cache"][0]), "expected k_cache with 4 dims"),
    ("k-head-dim", _set(k_cache=lambda a: a["k_cache"][..., :32]), "expected k_cache head dim 64"),
    ("v-shape", _set(v_cache=lambda a: a["v_cache"][:, :1]), r"expected v_cache of shape \[\d+, 2, 2, Dv\]"),
    ("gqa", _set(q=lambda a: a["q"][:, :3]), r"expected query heads divisible by KV heads \(2\), got 3"),
    (
        "pt-dtype",
        _set(page_table=lambda a: a["page_table"].long()),
        "expected page_table of dtype int32, got torch.int64",
    ),
    ("cu-dtype", _set(cu_seqlens_q=lambda a: a["cu_seqlens_q"].long()), "expected cu_seqlens_q of dtype int32"),
    ("sl-dtype", _set(seq_lens_k=lambda a: a["seq_lens_k"].long()), "expected seq_lens_k of dtype int32"),
    ("cu-len", _set(cu_seqlens_q=torch.tensor([0, 4], dtype=I32)), r"expected cu_seqlens_q of shape \[3\] \(B \+ 1\)"),
    ("pt-rows", _set(page_table=lambda a: a["page_table"][:1]), "expected page_table with 2 rows"),
    ("cu-start", _set(cu_seqlens_q=torch.tensor([1, 2, 4], dtype=I32)), r"expected cu_seqlens_q\[0\] == 0, got 1"),
    ("cu-order", _set(cu_seqlens_q=torch.tensor([0, 5, 4], dtype=I32)), "expected non-decreasing cu_seqlens_q"),
    ("cu-total", _set(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32)), r"expected cu_seqlens_q\[-1\] == 4"),
    (
        "k-lens",
        _set(seq_lens_k=torch.tensor([5, -1], dtype=I32)),
        r"expected seq_lens_k >= 0, got seq_lens_k\[1\] = -1",
    ),
    ("pt-width", _set(page_table=lambda a: a["page_table"][:, :2]), "expected page_table with at least 3 columns"),
    ("pt-range", _set(page_table=lambda a: a["page_table"] - 100), r"expected page ids in \[0, \d+\) for used pages"),
    ("window", _set(window_left=-2), "expected window_left to be an int >= -1, got -2"),
    ("window-type", _set(window_left=2.5), "expected window_left to be an int >= -1, got 2.5"),
    ("chunk", _set(attention_chunk_size=0), "expected attention_chunk_size to be None or a positive int, got 0"),
    ("softcap", _set(logit_softcap=-1.0), r"expected logit_softcap >= 0 \(0 disables it\), got -1.0"),
    ("scale", _set(scale=float("nan")), "expected a positive finite scale, got nan"),
    ("sinks-shape", _set(sinks=torch.zeros(3)), r"expected sinks of shape \[4\] \(one per query head\)"),
    ("sinks-dtype", _set(sinks=torch.zeros(4, dtype=I32)), "expected sinks of dtype"),
    ("out-shape", _set(out=torch.empty(4, 4, 32)), r"expected out of shape \[4, 4, 64\], got \[4, 4, 32\]"),
    ("out-dtype", _set(out=torch.empty(4, 4, 64, dtype=torch.float16)), "expected out of dtype float32"),
]


@pytest.mark.parametrize(("mutate", "message"), [pytest.param(m, msg, id=i) for i, m, msg in PAGED_CASES])
def test_paged_attention_rejects(mutate, message):
    args = paged_inputs()
    kwargs = {
        "window_left": -1,
        "attention_chunk_size": None,
        "logit_softcap": 0.0,
        "scale": None,
        "sinks": None,
        "out": None,
    }
    mutate(args, kwargs)
    with pytest.raises(ValueError, match=message):
        portattn.paged_attention(**args, **kwargs)


def varlen_inputs():
    q = torch.randn(7, 4, 16)
    k = torch.randn(9, 2, 16)
    v = torch.randn(9, 2, 8)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens([3, 4]), "cu_seqlens_k": cu_seqlens([4, 5])}


VARLEN_CASES = [
    ("k-shape", _set(k=lambda a: a["k"][:, :, :8]), r"expected k of shape \[9, 2, 16\]"),
    ("self-keys", _set(cu_seqlens_k=None), r"expected 7 keys \(as queries\) when cu_seqlens_k is None, got 9"),
    ("cu-k-shape", _set(cu_seqlens_k=cu_seqlens([9])), r"expected cu_seqlens_k of shape \[3\]"),
    ("cu-k-total", _set(cu_seqlens_k=cu_seqlens([4, 4])), r"expected cu_seqlens_k\[-1\] == 9"),
    ("max-q", _set(max_seqlen_q=3), "expected max_seqlen_q >= 4, got 3"),
    ("max-k", _set(max_seqlen_k=4), "expected max_seqlen_k >= 5, got 4"),
    ("window-pair", _set(window_size=(4,)), r"expected window_size as a \(left, right\) pair"),
    ("window-right", _set(window_size=(4, -3)), "expected window_right to be an int >= -1, got -3"),
    ("v-dtype", _set(v=lambda a: a["v"].double()), "expected v of dtype float32"),
    ("gqa", _set(q=lambda a: a["q"][:, :3]), "expected query heads divisible by KV heads"),
]


@pytest.mark.parametrize(("mutate", "message"), [pytest.param(m, msg, id=i) for i, m, msg in VARLEN_CASES])
def test_varlen_attention_rejects(mutate, message):
    args = varlen_inputs()
    kwargs = {"max_seqlen_q": None, "max_seqlen_k": None, "window_size": (-1, -1)}
    mutate(args, kwargs)
    with pytest.raises(ValueError, match=message):
        portattn.varlen_attention(**args, **kwargs)
