"""The Qwen2.5-VL vision tower against transformers' ``model.visual`` on tiny random checkpoints.

Two images of different grids go through one call; their merged grids are cut into several
windows, some of them partial, and two of the four blocks attend over whole images. Weights are
drawn large enough that attention is far from uniform, so a wrong window or a wrong permutation
shows (checked by ``test_the_parity_check_sees_wrong_windows``).
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import BACKENDS, DEVICE
from portattn import UnsupportedFeatureError
from portattn.encoder import EncoderSeqInfo
from portattn.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, load_vision_tower
from portattn.testing import tiny_vision_tower_model, vision_tower_config

GRIDS = [(1, 12, 8), (1, 6, 10)]  # merged 6x4 (6 full windows) and 3x5 (6 windows, 4 partial)
RTOL = 1e-5

# Head dim 16 and head dim 80 (Qwen2.5-VL's real one), on every backend.
VISION = ("d16", "d80")


@functools.cache
def _checkpoint(name: str, root: str) -> tuple[str, torch.nn.Module]:
    model = tiny_vision_tower_model(name)
    path = f"{root}/{name}"
    model.save_pretrained(path)
    return path, model.model.visual


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("qwen2_5_vl"))


def _inputs(grids, patch_dim: int, seed: int = 0):
    grid_thw = torch.tensor(grids)
    gen = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=gen)
    return pixel_values, grid_thw


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


@functools.cache
def _reference(name: str, root: str, grids: tuple) -> torch.Tensor:
    _, visual = _checkpoint(name, root)
    pixel_values, grid_thw = _inputs(list(grids), 96)
    with torch.no_grad():
        return visual(pixel_values, grid_thw).pooler_output  # merged embeddings, input order


CASES = [pytest.param(name, backend, id=f"{name}-{backend}") for name in VISION for backend in BACKENDS]


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_tower_equals_transformers(root, name, backend):
    path, _ = _checkpoint(name, root)
    tower = load_vision_tower(path, dtype=torch.float32, device=DEVICE, mm_attention_backend=backend)
    assert tower.attention.backend_name == backend
    pixel_values, grid_thw = _inputs(GRIDS, 96)
    out = tower(pixel_values.to(DEVICE), grid_thw)
    ref = _reference(name, root, tuple(GRIDS))
    assert out.shape == ref.shape == (24 + 15, 32)
    assert _rel_error(out.cpu(), ref) <= RTOL


def test_video_grids_and_one_unit_images(root):
    # Several frames per entry (each frame its own full-attention sequence), and a 1-unit image.
    grids = ((2, 4, 6), (1, 2, 2), (3, 8, 4))
    path, _ = _checkpoint("d16", root)
    tower = load_vision_tower(path, mm_attention_backend="torch")
    pixel_values, grid_thw = _inputs(list(grids), 96)
    assert _rel_error(tower(pixel_values, grid_thw), _reference("d16", root, grids)) <= RTOL


def test_the_parity_check_sees_wrong_windows(root):
    path, _ = _checkpoint("d16", root)
    tower = load_vision_tower(path, mm_attention_backend="torch")
    pixel_values, grid_thw = _inputs(GRIDS, 96)
    ref = _reference("d16", root, tuple(GRIDS))
    for block in tower.blocks:
        block.full_attention = True
    assert _rel_error(tower(pixel_values, grid_thw), ref) > 1e3 * RTOL


def test_both_checkpoint_layouts_load(root, tmp_path):
    # transformers writes the tower's tensors as `visual.*` (5.x) or `model.visual.*` (4.5x).
    path, _ = _checkpoint("d16", root)
    state = load_file(f"{path}/model.safetensors")
    assert any(k.startswith("visual.") for k in state)
    renamed = {("model." + k if k.startswith("visual.") else k): v for k, v in state.items()}
    shutil.copy(f"{path}/config.json", tmp_path)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    pixel_values, grid_thw = _inputs(GRIDS, 96)
    a = load_vision_tower(path, mm_attention_backend="torch")(pixel_values, grid_thw)
    b = load_vision_tower(tmp_path, mm_attention_backend="torch")(pixel_values, grid_thw)
    assert torch.equal(a, b)


def test_missing_weights_are_reported(root, tmp_path):
    path, _ = _checkpoint("d16", root)
    state = load_file(f"{path}/model.safetensors")
    del state["visual.blocks.2.attn.qkv.weight"]
    shutil.copy(f"{path}/config.json", tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['blocks.2.attn.qkv.weight'\]"):
        load_vision_tower(tmp_path)


def test_bad_inputs_raise_value_errors(root):
    path, _ = _checkpoint("d16", root)
    tower = load_vision_tower(path, mm_attention_backend="torch")
    pixel_values, grid_thw = _inputs(GRIDS, 96)
    with pytest.raises(ValueError, match=r"expected 156 patches in pixel_values .*, got 155"):
        tower(pixel_values[:-1], grid_thw)
    with pytest.raises(ValueError, match=r"pixel_values of shape \[num_patches, 96\]"):
        tower(pixel_values[:, :-1], grid_thw)
    with pytest.raises(ValueError, match="divisible by spatial_merge_size 2"):
        tower(pixel_values[: 3 * 8], torch.tensor([[1, 3, 8]]))


def test_triton_rejects_head_dim_above_256_at_construction():
    if "triton" not in BACKENDS:
        pytest.skip("triton does not run here")
    config = vision_tower_config("d16")
    config.hidden_size, config.num_heads = 264, 1
    with pytest.raises(UnsupportedFeatureError, match="head dim 264"):
        Qwen2_5_VisionTransformer(config, device=DEVICE, mm_attention_backend="triton")


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_after_planning(root, backend, monkeypatch):
    name = "d80" if backend == "triton" else "d16"
    path, _ = _checkpoint(name, root)
    tower = load_vision_tower(path, device=DEVICE, mm_attention_backend=backend)
    pixel_values, grid_thw = _inputs(GRIDS, 96)
    pixel_values = pixel_values.to(DEVICE)
    info = tower.plan(grid_thw)
    assert isinstance(info, EncoderSeqInfo)
    calls = []
    for method in SYNC_METHODS:
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            calls.append(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    out = tower.run(pixel_values, info)
    monkeypatch.undo()
    assert calls == [], f"host syncs in the forward after planning: {calls}"
    assert _rel_error(out.cpu(), _reference(name, root, tuple(GRIDS))) <= RTOL
