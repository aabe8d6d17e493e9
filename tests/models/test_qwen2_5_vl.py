"""Qwen2.5-VL image prompts through the engine against transformers' own model, on a tiny random
checkpoint: image embeddings, greedy tokens and logits at page sizes 1 and 16 (whole prompts, prefill
chunks that cut an image, prefix caching), multi-image prompts, prefix-cache keys that see the
image content, mrope positions, and the errors for prompts whose placeholders do not fit the images."""

from __future__ import annotations

import functools
import shutil
import sys

import pytest
import torch

from portattn.engine.llm import LLM
from portattn.engine.sampling_params import SamplingParams
from portattn.models.qwen2_5_vl import mrope_positions, placeholder_runs
from portattn.runtime.multimodal import MultimodalData
from portattn.testing import IMAGE_PAD, PATCH_DIM, VISION_END, VISION_START, transformers_generate
from tiny_models import ENGINE_DEVICE, checkpoint, hf_model, rel_err

PAD, START, END = IMAGE_PAD, VISION_START, VISION_END  # 250, 248, 249 in the tiny checkpoint's vocabulary
TOL = 1e-4
MAX_NEW = 10


def image(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    """Random patches ``[t*h*w, PATCH_DIM]`` of one image."""
    t, h, w = grid
    return torch.randn(t * h * w, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def images(spec: tuple) -> dict:
    """``multi_modal_data`` of images given as ``((grid, seed), ...)``."""
    return {
        "pixel_values": torch.cat([image(g, s) for g, s in spec]),
        "image_grid_thw": torch.tensor([g for g, _ in spec]),
    }


def pads(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [START, *[PAD] * (t * h * w // 4), END]


@functools.cache
def hf_reference(path: str, ids: tuple[int, ...], spec: tuple, max_new: int = MAX_NEW):
    """``(greedy tokens, generated-token logits [N, V], prompt logits [n, V])`` from transformers."""
    return transformers_generate(hf_model(path), prompt(ids, spec) if spec else list(ids), max_new)


G1, G2 = (1, 8, 8), (1, 4, 12)  # 16 and 12 merged patches; after them text resumes 4 and 6 positions on
ONE = (5, 6, *pads(G1), 7, 8, 9)  # the image's pads are tokens 3..18: chunks of 8 cut it twice
ONE_IMAGE = ((G1, 1),)
TWO = (17, *pads(G1), 30, 31, *pads(G2), 40, 41, 42)
TWO_IMAGES = ((G1, 2), (G2, 3))


@pytest.fixture(scope="module")
def path(ckpt_root) -> str:
    return checkpoint("qwen2_5_vl", ckpt_root)


def prompt(ids, spec) -> dict:
    return {"prompt_token_ids": list(ids), "multi_modal_data": images(spec)}


def run(llm: LLM, prompts: list[tuple], prompt_logits: bool):
    params = SamplingParams(
        temperature=0, max_tokens=MAX_NEW, ignore_eos=True, return_logits=True, return_prompt_logits=prompt_logits
    )
    inputs = [prompt(ids, spec) if spec else list(ids) for ids, spec in prompts]
    return llm.generate(inputs, params, use_tqdm=False)


def check(llm: LLM, path: str, prompts: list[tuple], prompt_logits: bool = True) -> float:
    worst = 0.0
    for (ids, spec), out in zip(prompts, run(llm, prompts, prompt_logits)):
        tokens, logits, ref_prompt_logits = hf_reference(path, tuple(ids), spec)
        assert out.token_ids == tokens
        worst = max(worst, rel_err(out.logits, logits))
        if prompt_logits:
            worst = max(worst, rel_err(out.prompt_logits, ref_prompt_logits))
    return worst


def test_encode_images_equals_transformers_visual(path):
    llm = LLM(path, page_size=16, num_pages=8, max_model_len=128)
    data = images(TWO_IMAGES)
    got = llm.encode_images(data["pixel_values"], data["image_grid_thw"])
    with torch.no_grad():
        want = hf_model(path).model.visual(data["pixel_values"], grid_thw=data["image_grid_thw"]).pooler_output
    assert got.shape == want.shape == (16 + 12, 64)
    assert rel_err(got, want) < 1e-5


def test_mrope_positions_equal_get_rope_index(path):
    ids = torch.tensor([TWO])
    grid = torch.tensor([G1, G2])
    want, want_delta = hf_model(path).model.get_rope_index(ids, (ids == PAD).int(), image_grid_thw=grid)
    runs = placeholder_runs(list(TWO), PAD)
    assert runs == [(2, 18), (22, 34)]
    got, delta = mrope_positions(len(TWO), runs, [G1, G2], 2)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    assert delta != 0  # images advance positions by max(h, w) / merge, not by their token count


@pytest.mark.parametrize("mode", ["whole", "chunked", "prefix"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_image_prompt_matches_transformers(path, page_size, mode):
    llm = LLM(
        path,
        page_size=page_size,
        num_pages=-(-256 // page_size),
        max_model_len=256,
        max_num_seqs=4,
        chunked_prefill_size=8 if mode == "chunked" else None,
        enable_prefix_caching=mode == "prefix",
        device=ENGINE_DEVICE,
    )
    err = check(llm, path, [(ONE, ONE_IMAGE)], prompt_logits=mode != "prefix")
    if mode == "prefix":  # the same prompt and image again: its full pages come from the cache
        err = max(err, check(llm, path, [(ONE, ONE_IMAGE)], prompt_logits=False))
        assert llm.engine.pages.num_cached_tokens == (len(ONE) - 1) // page_size * page_size
    assert err < TOL


def test_multi_image_prompt_beside_a_text_prompt(path):
    # Chunks of 8 tokens cut both images; the text prompt shares forwards with the image prompt.
    llm = LLM(
        path,
        page_size=7,
        num_pages=64,
        max_model_len=448,
        chunked_prefill_size=8,
        enable_prefix_caching=True,
        device=ENGINE_DEVICE,
    )
    assert check(llm, path, [(TWO, TWO_IMAGES), (tuple(range(3, 20)), ())]) < TOL


def test_different_images_do_not_share_pages(path, monkeypatch):
    # Page 0 (tokens 0-3) is text; every later page overlaps the image or follows it.
    ids = (9, 10, 11, 12, 13, 14, *pads(G1), 15, 16, 17)
    a, b = ((G1, 4),), ((G1, 5),)
    llm = LLM(path, page_size=4, num_pages=64, max_model_len=256, enable_prefix_caching=True)
    pages = llm.engine.pages
    check(llm, path, [(ids, a)], prompt_logits=False)
    assert pages.num_cached_tokens == 0
    check(llm, path, [(ids, b)], prompt_logits=False)
    assert pages.num_cached_tokens == 4  # only the text page before the image
    assert hf_reference(path, ids, a)[0] != hf_reference(path, ids, b)[0]
    check(llm, path, [(ids, a)], prompt_logits=False)
    assert pages.num_cached_tokens == 4 + (len(ids) - 1) // 4 * 4  # the same image again: every full page

    # Keys without the image content would hand image b the pages of image a.
    monkeypatch.setattr(MultimodalData, "content_key", lambda self, first, last: b"")
    blind = LLM(path, page_size=4, num_pages=64, max_model_len=256, enable_prefix_caching=True)
    run(blind, [(ids, a)], prompt_logits=False)
    assert run(blind, [(ids, b)], prompt_logits=False)[0].token_ids != hf_reference(path, ids, b)[0]


def test_embeddings_are_computed_once_per_request(path, monkeypatch):
    llm = LLM(path, page_size=4, num_pages=64, max_model_len=256, chunked_prefill_size=5)
    model = llm.engine.model
    calls = []
    plan = model.plan_images  # the engine plans the tower's sequences once per encoder call, then runs it
    monkeypatch.setattr(model, "plan_images", lambda grid: calls.append(list(grid)) or plan(grid))
    check(llm, path, [(ONE, ONE_IMAGE), (TWO, TWO_IMAGES)], prompt_logits=False)
    assert sorted(g for call in calls for g in call) == sorted([G1, G1, G2])  # each request's images, once


def test_placeholders_must_fit_the_images(path, ckpt_root):
    llm = LLM(path, page_size=4, num_pages=32, max_model_len=128)
    params = SamplingParams(max_tokens=2)
    short = [*ONE[:10], *ONE[11:]]  # 15 pads for a 16-patch image
    with pytest.raises(ValueError, match=r"expected 16 image pad tokens for image 0 \(grid 1x8x8, merge 2\), got 15"):
        llm.generate([list(range(3, 20)), prompt(short, ONE_IMAGE)], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing was queued
    with pytest.raises(ValueError, match=r"expected 2 runs of image pad tokens .*, got 1"):
        llm.generate(prompt(ONE, TWO_IMAGES), params, use_tqdm=False)
    with pytest.raises(ValueError, match="expected multi_modal_data for the prompt's image pad tokens"):
        llm.generate([list(ONE)], params, use_tqdm=False)
    data = images(ONE_IMAGE)
    with pytest.raises(ValueError, match=r"expected 64 patches \(sum of t\*h\*w\), got 63"):
        llm.generate(
            {"prompt_token_ids": list(ONE), "multi_modal_data": {**data, "pixel_values": data["pixel_values"][1:]}}
        )
    with pytest.raises(ValueError, match="expected multi_modal_data keys"):
        llm.generate({"prompt_token_ids": list(ONE), "multi_modal_data": {"pixel_values": data["pixel_values"]}})
    with pytest.raises(ValueError, match="expected a multimodal model for images"):
        LLM(checkpoint("llama", ckpt_root), num_pages=4, max_model_len=64).encode_images(**data)


def test_mm_backend_selection(path, monkeypatch):
    pool = dict(num_pages=8, max_model_len=128)
    assert LLM(path, **pool, mm_attention_backend="sdpa").engine.model.visual.attention.backend_name == "sdpa"
    monkeypatch.setenv("PORTATTN_MM_ATTENTION_BACKEND", "sdpa")
    assert LLM(path, **pool).engine.model.visual.attention.backend_name == "sdpa"
    explicit = LLM(path, **pool, mm_attention_backend="torch")  # an explicit name wins over the env var
    assert explicit.engine.model.visual.attention.backend_name == "torch"


def test_raw_images_through_the_checkpoint_processor(path, tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    try:  # transformers before 5.2x: AutoImageProcessor needs torchvision
        from transformers import AutoImageProcessor

        AutoImageProcessor.register  # noqa: B018
    except ImportError as exc:
        pytest.skip(f"transformers' AutoImageProcessor is unavailable here: {str(exc).strip().splitlines()[0]}")
    from transformers import Qwen2VLImageProcessor

    shutil.copytree(path, tmp_path / "ckpt")
    array = torch.rand(30, 34, 3, generator=torch.Generator().manual_seed(6)).mul(255).to(torch.uint8).numpy()
    llm = LLM(tmp_path / "ckpt", page_size=4, num_pages=64, max_model_len=256)
    one_pad = {"prompt_token_ids": [5, START, PAD, END, 7], "multi_modal_data": {"image": array}}
    with pytest.raises(ValueError, match=r"expected preprocessor_config\.json"):
        llm.generate(one_pad, use_tqdm=False)

    processor = Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=4096
    )
    processor.save_pretrained(tmp_path / "ckpt")
    data = dict(processor(images=[array], return_tensors="pt"))
    (grid,) = data["image_grid_thw"].tolist()
    expanded = [5, START, *[PAD] * (grid[0] * grid[1] * grid[2] // 4), END, 7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": expanded, "multi_modal_data": data}, params, use_tqdm=False)[0]
    got = llm.generate(one_pad, params, use_tqdm=False)[0]
    assert got.prompt_token_ids == expanded and got.token_ids == want.token_ids

    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match="pip install pillow"):
        llm.generate(one_pad, params, use_tqdm=False)


def test_demo_runs_the_vision_family(capsys):
    from portattn.cli import main

    argv = ["demo", "--families", "qwen2_5_vl", "--page-sizes", "5", "--num-prompts", "2", "--max-tokens", "4"]
    assert main([*argv, "--no-real-model"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("qwen2_5_vl")]
    assert [(r[1], r[2], r[4]) for r in rows] == [("5", "no", "yes"), ("16", "yes", "yes")]
    assert "all greedy outputs equal transformers'" in out
