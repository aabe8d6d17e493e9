"""Where a bf16 engine's logits part from the float32 model: the real model (SmolLM2-135M-Instruct)
on a GPU, the engine's paths switched one at a time, against transformers' own bf16 error.

For each of 40 prompts of the real-text chat set, the last prompt position's logits of the float32 model
(transformers, on the GPU) are the reference; every configuration reports the max |error| over the
vocabulary (worst prompt and mean over prompts) and its ratio to transformers' bf16, plus its greedy
answer to the first prompt. Configurations: the attention backend (triton / torch) and the fused
elementwise kernels (on / off), so the extra error of a path shows as the difference between rows.
Per layer, the hidden states after each decoder layer are compared with transformers' float32 ones.

    python -m benchmarks.bf16_error --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from . import prompt_sets

# The first 40 prompts of the real-text chat set (the first is "What is the capital of France?").
PROMPTS = prompt_sets.read("chat")[:40]


def convert(gguf: Path, folder: Path) -> None:
    """transformers' own GGUF loading, saved as a float32 safetensors checkpoint with its tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model it loaded from GGUF: write its tensors and config directly.
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)


def prompt_ids(tokenizer) -> list[list[int]]:
    return prompt_sets.chat_ids(tokenizer, PROMPTS)


@torch.inference_mode()
def transformers_logits(folder: Path, ids: list[list[int]], dtype: torch.dtype, hidden: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").cuda()
    logits, states = [], None
    for i, row in enumerate(ids):
        out = model(torch.tensor([row], device="cuda"), output_hidden_states=hidden and i == 0)
        logits.append(out.logits[0, -1].float().cpu())
        if hidden and i == 0:
            states = [h[0].float().cpu() for h in out.hidden_states]
    del model
    torch.cuda.empty_cache()
    return logits, states


def engine_run(folder: Path, ids: list[list[int]], backend: str, fused: bool, layer_hook: bool):
    from portattn.engine.llm import LLM
    from portattn.engine.sampling_params import SamplingParams
    from portattn.models.layers.fused import set_fused_kernels

    set_fused_kernels(fused)
    llm = LLM(
        str(folder), device="cuda", dtype="bfloat16", attention_backend=backend, max_model_len=2048, enforce_eager=True
    )
    states = []
    handles = []
    if layer_hook:
        layers = [m for name, m in llm.engine.model.named_modules() if name.count(".") == 2 and ".layers." in name]

        def keep(_module, _args, out):
            if len(states) < len(layers):  # the first prompt's prefill only
                hidden, residual = out if isinstance(out, tuple) else (out, None)
                states.append((hidden if residual is None else hidden + residual).float().cpu())

        handles = [layer.register_forward_hook(keep) for layer in layers]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
    outs = llm.generate([list(r) for r in ids], greedy, use_tqdm=False)
    logits = [o.logits[0].float().cpu() for o in outs]  # [V]: the logits that chose the first token
    for h in handles:
        h.remove()
    answer = llm.generate([list(ids[0])], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    text = answer.outputs[0].text
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    set_fused_kernels(True)
    return logits, states, text


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [float((g - r).abs().max()) for g, r in zip(got, ref)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep the converted float32 checkpoint in this folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp) / "smollm2"
        if not (folder / "config.json").exists():
            convert(args.gguf, folder)
        from transformers import AutoTokenizer

        ids = prompt_ids(AutoTokenizer.from_pretrained(folder))
        ref, ref_states = transformers_logits(folder, ids, torch.float32, hidden=True)
        hf_bf16, _ = transformers_logits(folder, ids, torch.bfloat16)
        base = errors(hf_bf16, ref)
        rows = [{"config": "transformers bf16", "max": max(base), "mean": statistics.mean(base), "ratio": 1.0}]
        layers = {}
        for backend in ("triton", "torch"):
            for fused in (True, False):
                name = f"portattn {backend}, fused {'on' if fused else 'off'}"
                logits, states, text = engine_run(folder, ids, backend, fused, layer_hook=True)
                err = errors(logits, ref)
                rows.append(
                    {
                        "config": name,
                        "max": max(err),
                        "mean": statistics.mean(err),
                        "ratio": statistics.mean(err) / statistics.mean(base),
                        "per_prompt": err,
                        "answer": text,
                    }
                )
                if states and ref_states:
                    # the prompts run as one packed forward: the first prompt's rows come first
                    layers[name] = [float((s[: r.shape[0]] - r).abs().max()) for s, r in zip(states, ref_states[1:])]
        print(f"{'config':34} {'max err':>9} {'mean err':>9} {'x hf bf16':>9}  answer")
        for r in rows:
            print(f"{r['config']:34} {r['max']:9.3f} {r['mean']:9.3f} {r['ratio']:9.2f}  {r.get('answer', '')!r}")
        for name, errs in layers.items():
            print(f"per layer, {name}: " + " ".join(f"{e:.2f}" for e in errs))
        if args.out is not None:
            args.out.write_text(json.dumps({"prompts": PROMPTS, "rows": rows, "layers": layers}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
