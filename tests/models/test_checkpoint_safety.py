"""Checkpoints are data: no code from them runs, shards stay in their folder, and every unreadable file
is one CLI line naming it (exit status 2, the traceback only with -v)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from portattn import __version__
from portattn.cli import main
from portattn.engine.llm import LLM
from portattn.models import loader
from portattn.testing import IMAGE_PAD, VISION_END, VISION_START
from tiny_models import checkpoint

REMOTE_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
{body}
"""


def copy_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(file: Path, **changes) -> None:
    file.write_text(json.dumps({**(json.loads(file.read_text()) if file.exists() else {}), **changes}))


@pytest.fixture
def answer_yes(monkeypatch):
    """transformers asks on standard input whether to run a checkpoint's code: the answer is yes."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 8))


def add_code(path: Path, marker: Path, body: str) -> None:
    (path / "custom.py").write_text(REMOTE_CODE.format(marker=str(marker), body=body))


def test_config_auto_map_is_refused_and_never_run(tmp_path, ckpt_root, answer_yes):
    path = copy_checkpoint(checkpoint("llama", ckpt_root), tmp_path / "ckpt")
    marker = tmp_path / "ran"
    body = "from transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = 'portattn_custom'"
    add_code(path, marker, body)
    edit_json(path / "config.json", model_type="portattn_custom", auto_map={"AutoConfig": "custom.CustomConfig"})
    with pytest.raises(ValueError, match=r"never runs code from a checkpoint.*auto_map .*in config\.json"):
        LLM(path, num_pages=8, max_model_len=128)
    assert not marker.exists()


def test_tokenizer_auto_map_is_refused_and_never_run(tmp_path, ckpt_root, answer_yes):
    path = copy_checkpoint(checkpoint("llama", ckpt_root), tmp_path / "ckpt")
    marker = tmp_path / "ran"
    body = "from transformers import PreTrainedTokenizer\nclass CustomTokenizer(PreTrainedTokenizer):\n    pass"
    add_code(path, marker, body)
    edit_json(
        path / "tokenizer_config.json",
        tokenizer_class="CustomTokenizer",
        auto_map={"AutoTokenizer": ["custom.CustomTokenizer", None]},
    )
    with pytest.raises(ValueError, match=r"auto_map .*in tokenizer_config\.json"):
        loader.load_tokenizer(path)
    with pytest.raises(ValueError, match=r"auto_map .*in tokenizer_config\.json"):
        LLM(path, num_pages=8, max_model_len=128)
    assert not marker.exists()


def test_image_processor_auto_map_is_refused_and_never_run(tmp_path, ckpt_root, answer_yes):
    pytest.importorskip("PIL")
    path = copy_checkpoint(checkpoint("qwen2_5_vl", ckpt_root), tmp_path / "ckpt")
    marker = tmp_path / "ran"
    body = "from transformers import Qwen2VLImageProcessor\nclass CustomProcessor(Qwen2VLImageProcessor):\n    pass"
    add_code(path, marker, body)
    edit_json(
        path / "preprocessor_config.json",
        image_processor_type="CustomProcessor",
        auto_map={"AutoImageProcessor": "custom.CustomProcessor"},
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=256,
        max_pixels=4096,
    )
    llm = LLM(path, page_size=4, num_pages=64, max_model_len=256)
    array = torch.rand(30, 34, 3, generator=torch.Generator().manual_seed(6)).mul(255).to(torch.uint8).numpy()
    prompt = {"prompt_token_ids": [5, VISION_START, IMAGE_PAD, VISION_END, 7], "multi_modal_data": {"image": array}}
    with pytest.raises(ValueError, match=r"auto_map .*in preprocessor_config\.json"):
        llm.generate(prompt, use_tqdm=False)
    assert not marker.exists()


def test_every_transformers_load_passes_trust_remote_code_false(tmp_path, ckpt_root, monkeypatch):
    import transformers

    path = copy_checkpoint(checkpoint("llama", ckpt_root), tmp_path / "ckpt")
    calls = {}

    def spy(name, original):
        def load(*args, **kwargs):
            calls[name] = kwargs.get("trust_remote_code", "unset")
            return original(*args, **kwargs)

        return load

    loaders = [("config", transformers.AutoConfig), ("tokenizer", transformers.AutoTokenizer)]
    loaders.append(("generation", transformers.GenerationConfig))
    with contextlib.suppress(ImportError):  # transformers before 5.2x without torchvision has no image processors
        loaders.append(("image", transformers.AutoImageProcessor.from_pretrained.__self__))
    for name, cls in loaders:
        monkeypatch.setattr(cls, "from_pretrained", spy(name, cls.from_pretrained))
    (path / "tokenizer.json").write_text("{}")  # any tokenizer file: the load is what is spied on
    with pytest.raises(ValueError):
        loader.load_tokenizer(path)
    loader.load_config(path)
    loader.eos_token_ids(path, loader.load_config(path))
    (path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ValueError):
        loader.load_image_processor(path)
    assert calls == {name: False for name, _ in loaders} and len(loaders) >= 3


def test_a_native_model_type_beside_an_auto_map_loads_without_the_code(tmp_path, ckpt_root, answer_yes):
    # Hub checkpoints of families transformers has (DeepSeek-V3's) still ship an auto_map.
    path = copy_checkpoint(checkpoint("llama", ckpt_root), tmp_path / "ckpt")
    marker = tmp_path / "ran"
    add_code(path, marker, "")
    edit_json(path / "config.json", auto_map={"AutoConfig": "custom.Anything"})
    assert type(loader.load_config(path)).__name__ == "LlamaConfig"
    assert not marker.exists()


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors"]
)
def test_shard_names_are_confined_to_the_checkpoint(tmp_path, ckpt_root, name):
    path = copy_checkpoint(checkpoint("llama", ckpt_root), tmp_path / "ckpt")
    shutil.copy(path / "model.safetensors", tmp_path / "outside.safetensors")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
    with pytest.raises(ValueError, match=r"shard names inside the checkpoint directory"):
        loader.safetensors_files(path)


def _truncate(file: Path, keep: int) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: keep if keep >= 0 else len(data) + keep])


CORRUPTIONS = {
    "config not JSON": ("config.json", lambda p: (p / "config.json").write_text("{")),
    "config empty": ("config.json", lambda p: (p / "config.json").write_text("")),
    "config value transformers rejects": ("config.json", lambda p: edit_json(p / "config.json", hidden_size="abc")),
    "config negative heads": ("config.json", lambda p: edit_json(p / "config.json", num_attention_heads=-4)),
    "safetensors truncated header": ("model.safetensors", lambda p: _truncate(p / "model.safetensors", 100)),
    "safetensors truncated data": ("model.safetensors", lambda p: _truncate(p / "model.safetensors", -100)),
    "safetensors empty": ("model.safetensors", lambda p: (p / "model.safetensors").write_bytes(b"")),
    "safetensors garbled": ("model.safetensors", lambda p: (p / "model.safetensors").write_bytes(b"\x99" * 3000)),
    "index names a missing shard": (
        "missing.safetensors",
        lambda p: edit_json(p / "model.safetensors.index.json", weight_map={"a": "missing.safetensors"}),
    ),
    "index without weight_map": (
        "model.safetensors.index.json",
        lambda p: edit_json(p / "model.safetensors.index.json", metadata={}),
    ),
    "index garbled": (
        "model.safetensors.index.json",
        lambda p: (p / "model.safetensors.index.json").write_text("{garbled"),
    ),
    "generation config garbled": (
        "generation_config.json",
        lambda p: (p / "generation_config.json").write_text("{garbled"),
    ),
    "tokenizer.json garbled": ("tokenizer.json", lambda p: (p / "tokenizer.json").write_text("{garbled")),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_bad_checkpoint_file_is_one_cli_line_naming_it(case, tmp_path, ckpt_root, capsys):
    path = copy_checkpoint(checkpoint("llama", ckpt_root), tmp_path / "ckpt")
    file, corrupt = CORRUPTIONS[case]
    corrupt(path)
    argv = ["generate", "--model", str(path), "--prompt-ids", "1,2", "--num-pages", "8", "--max-model-len", "128"]
    capsys.readouterr()  # the session's first checkpoint writes a progress bar: not the command's output
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("portattn generate: error: ") and err.count("\n") == 1, err
    assert file in err and "Traceback" not in err
    with pytest.raises(ValueError, match=file.replace(".", r"\.")):  # -v after the command: the exception itself
        main([*argv, "-v"])


def test_cli_version_and_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"portattn {__version__}"
    for argv, flag in [
        (["generate", "--model", "x", "--page-size", "many"], "--page-size"),
        (["generate"], "--model"),
        (["check", "--dtype", "fp8"], "--dtype"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and flag in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--page-size", "0", "--backend", "torch"], "expected --page-size >= 1, got 0"),
        (["check", "--backend", "nope"], "expected --backend in"),
        (["check", "--device", "foo"], "--device: expected a device such as cpu"),
        (["generate", "--model", "M", "--prompt-ids", "1,x"], "expected --prompt-ids as comma-separated ints"),
        (["generate", "--model", "M"], "expected at least one --prompt or --prompt-ids"),
        (["generate", "--model", "M", "--prompt-ids", "1", "--device", "foo"], "expected a device such as cpu"),
        (["generate", "--model", "M", "--prompt-ids", "1", "--num-pages", "1"], "num_pages (--num-pages) >= 128"),
        (["generate", "--model", "M", "--prompt-ids", "1", "--max-model-len", "4096"], "max_position_embeddings 2048"),
    ],
)
def test_bad_flags_are_one_line_naming_them(argv, message, ckpt_root, capsys):
    argv = [checkpoint("llama", ckpt_root) if a == "M" else a for a in argv]
    capsys.readouterr()  # the session's first checkpoint writes a progress bar: not the command's output
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch build has CUDA")
def test_cuda_on_a_cpu_only_build_names_the_devices_here(ckpt_root, capsys):
    argv = ["generate", "--model", checkpoint("llama", ckpt_root), "--prompt-ids", "1", "--device", "cuda"]
    assert main(argv) == 2
    assert "cuda is not available: this torch build has no CUDA; devices here: cpu" in capsys.readouterr().err
