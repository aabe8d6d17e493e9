"""Encoder attention: per-forward sequence facts against transformers' own, backend choice at selection.

Sequence offsets, windows and positions are integers: compared with exact equality against the
functions ``transformers`` uses in ``Qwen2_5_VisionTransformerPretrainedModel``. Attention through
:class:`EncoderAttention` is compared with the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

from conftest import BACKENDS, DEVICE
from portattn import UnsupportedFeatureError
from portattn.backends.registry import backend_class
from portattn.backends.torch_ref import TorchBackend
from portattn.encoder import EncoderAttention, EncoderSeqInfo, grid_list, window_partition
from portattn.testing import cu_seqlens, max_error, tolerance, varlen_attention_ref

# (grids, spatial_merge_size, patch_size, window_size): merged grids divisible and not by the
# window, a single unit, several frames (video), tall and wide images, Qwen2.5-VL's real settings.
GRID_CASES = [
    ([(1, 12, 8), (1, 6, 10)], 2, 4, 16),
    ([(1, 2, 2)], 2, 4, 16),
    ([(2, 8, 8), (1, 4, 14), (3, 2, 6)], 2, 4, 16),
    ([(1, 16, 16), (1, 10, 6)], 2, 4, 24),
    ([(1, 36, 50), (2, 14, 28), (1, 98, 4)], 2, 14, 112),
    ([(1, 9, 6)], 3, 2, 12),
    ([(1, 5, 7)], 1, 2, 4),
]


def _window_units(merge, patch, window):
    return window // merge // patch


@pytest.mark.parametrize(("grids", "merge", "patch", "window"), GRID_CASES)
def test_seq_info_equals_transformers(grids, merge, patch, window):
    grid_thw = torch.tensor(grids)
    info = EncoderSeqInfo.from_grid(
        TorchBackend(),
        grid_thw,
        spatial_merge_size=merge,
        window_units=_window_units(merge, patch, window),
        device="cpu",
    )
    hf_index, hf_cu_window = get_vision_window_index(
        grid_thw, spatial_merge_size=merge, window_size=window, patch_size=patch
    )
    hf_cu = get_vision_cu_seqlens(grid_thw)
    assert torch.equal(info.window_index, hf_index)
    assert torch.equal(info.reverse_index, torch.argsort(hf_index))
    assert torch.equal(info.window.cu_seqlens_q, hf_cu_window) and info.window.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(info.full.cu_seqlens_q, hf_cu) and info.full.cu_seqlens_k is info.full.cu_seqlens_q
    for meta, cu in ((info.full, hf_cu), (info.window, hf_cu_window)):
        lens = (cu[1:] - cu[:-1]).tolist()
        assert meta.q_lens == tuple(lens) and meta.k_lens == tuple(lens)
        assert type(meta.max_seqlen_q) is int and meta.max_seqlen_q == max(lens) == meta.max_seqlen_k
    # Positions: transformers computes them in input order and permutes them with the tokens.
    unit = merge * merge
    hf_pos = get_vision_position_ids(grid_thw, merge)  # [N, 2]
    hf_pos = hf_pos.view(-1, unit, 2)[hf_index].view(-1, 2)
    assert torch.equal(info.positions, hf_pos)
    assert info.num_tokens == hf_cu[-1] and info.unit == unit


def test_windows_never_cross_a_frame():
    # Full-attention blocks reuse the frame offsets on window-ordered tokens: every window must
    # lie inside one frame, so that the window order only moves tokens within their frame.
    grids = [(2, 8, 12), (1, 6, 6), (3, 4, 2)]
    index, lengths = window_partition(grids, 2, 3)
    frame_of_unit = torch.cat([torch.arange(t).repeat_interleave(h * w // 4) for t, h, w in grids])
    frame_of_unit += torch.tensor([0, 2, 3]).repeat_interleave(torch.tensor([t * h * w // 4 for t, h, w in grids]))
    frames = frame_of_unit[index]
    start = 0
    for n in lengths:
        assert frames[start // 4 : (start + n) // 4].unique().numel() == 1
        start += n
    assert torch.equal(frames, frame_of_unit)  # frames keep their order


def test_window_order_round_trip_is_exact():
    info = EncoderSeqInfo.from_grid(
        TorchBackend(), [(1, 12, 8), (2, 6, 10)], spatial_merge_size=2, window_units=2, device="cpu"
    )
    x = torch.randn(info.num_tokens, 5)
    units = x.view(-1, 4, 5)  # [U, unit, 5]
    moved = info.to_window_order(x)
    assert torch.equal(moved.view(-1, 4, 5), units[info.window_index])
    assert torch.equal(info.from_window_order(moved.view(-1, 20)).view(-1, 5), x)


def test_seq_info_without_windows_is_the_frames():
    info = EncoderSeqInfo.from_grid(TorchBackend(), [(2, 4, 4), (1, 2, 6)], spatial_merge_size=2, device="cpu")
    assert info.window is info.full and info.window_index is None
    assert info.full.q_lens == (16, 16, 12)
    x = torch.randn(44, 3)
    assert info.to_window_order(x) is x


@pytest.mark.parametrize(
    ("grid", "match"),
    [
        (torch.tensor([[1, 5, 4]]), "divisible by spatial_merge_size 2"),
        (torch.tensor([[1, 4, 4.0]]), "integer dtype"),
        (torch.tensor([1, 4, 4]), r"shape \[num_images, 3\]"),
        (torch.tensor([[0, 4, 4]]), "positive ints"),
    ],
)
def test_bad_grids_raise_value_errors(grid, match):
    with pytest.raises(ValueError, match=match):
        grid_list(grid, 2)


# -- attention through EncoderAttention ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", ["full", "window_sinks"])
def test_encoder_attention_matches_float64_reference(backend, feature):
    dtype, heads, head_dim = torch.float32, 4, 80
    lens = [1, 17, 5, 33, 2]
    kwargs = {}
    if feature == "window_sinks":
        kwargs = {"window_size": (8, 8), "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)}
    try:
        attention = EncoderAttention(heads, head_dim, dtype=dtype, device=DEVICE, backend=backend, **kwargs)
    except UnsupportedFeatureError as exc:
        assert backend == "sdpa", "torch and triton declare windows and sinks"
        assert exc.supported_by == ["torch", "triton"]
        return
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), heads, head_dim, generator=gen).to(DEVICE) for _ in range(3))
    info = EncoderSeqInfo.from_lengths(attention.backend, lens, device=DEVICE)
    out = attention(q, k, v, info.full)
    cu = cu_seqlens(lens, DEVICE)
    ref = varlen_attention_ref(q, k, v, cu, **kwargs)
    lowp = varlen_attention_ref(q.float(), k.float(), v.float(), cu, upcast=False, **kwargs)
    assert max_error(out, ref) <= tolerance(ref, lowp, dtype)


@pytest.mark.parametrize(
    ("kwargs", "feature"),
    [
        ({"window_size": (8, 8)}, "sliding window"),
        ({"sinks": torch.zeros(4)}, "sinks"),
        ({"logit_softcap": 5.0}, "logit_softcap"),
    ],
)
def test_sdpa_rejects_missing_features_at_selection(kwargs, feature):
    with pytest.raises(UnsupportedFeatureError, match=feature) as info:
        EncoderAttention(4, 80, dtype=torch.float32, device="cpu", backend="sdpa", **kwargs)
    assert not isinstance(info.value, TypeError)
    assert "'torch'" in str(info.value) and "'triton'" in str(info.value)
    assert info.value.backend == "sdpa"


def test_env_var_selects_and_explicit_name_wins(monkeypatch):
    monkeypatch.setenv("PORTATTN_MM_ATTENTION_BACKEND", "torch")
    assert EncoderAttention(4, 80, dtype=torch.float32, device="cpu").backend_name == "torch"
    assert EncoderAttention(4, 80, dtype=torch.float32, device="cpu", backend="sdpa").backend_name == "sdpa"
    monkeypatch.setenv("PORTATTN_MM_ATTENTION_BACKEND", "sdpa")
    with pytest.raises(UnsupportedFeatureError, match="sinks"):  # the env var's choice is checked too
        EncoderAttention(4, 80, dtype=torch.float32, device="cpu", sinks=torch.zeros(4))
    monkeypatch.delenv("PORTATTN_MM_ATTENTION_BACKEND")
    # auto skips sdpa, which lacks sinks, instead of failing later
    auto = EncoderAttention(4, 80, dtype=torch.float32, device="cpu", sinks=torch.zeros(4)).backend_name
    assert backend_class(auto).capabilities.supports("feature", "sinks")


def test_unsupported_head_dim_is_reported_at_selection():
    if "triton" not in BACKENDS:
        pytest.skip("triton does not run here")
    with pytest.raises(UnsupportedFeatureError, match="head dim 264") as info:
        EncoderAttention(4, 264, dtype=torch.float32, device=DEVICE, backend="triton")
    assert "'torch'" in str(info.value) and "'sdpa'" in str(info.value)
