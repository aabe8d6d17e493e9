"""Offline batched generation with ``portattn.LLM``.

    python examples/offline_generate.py MODEL   # a checkpoint directory, or a model id in the local
                                                # Hugging Face cache (hf download MODEL fetches one)
    python examples/offline_generate.py         # a tiny random checkpoint made here: fast, offline,
                                                # and its text is gibberish

The engine picks the accelerator if there is one (else the CPU), the checkpoint's dtype there, and a
KV cache sized from free memory; the INFO line at start-up says what it chose.
"""

from __future__ import annotations

import sys
import tempfile

import portattn
from portattn.testing import save_tiny_chat_checkpoint


def main(model: str) -> None:
    llm = portattn.LLM(model, max_model_len=1024)
    prompts = ["The capital of France is", "Paged attention keeps the KV cache in", "1, 2, 3, 4,"]
    greedy = portattn.SamplingParams(temperature=0.0, max_tokens=24)
    for out in llm.generate(prompts, greedy):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({len(out.outputs[0].token_ids)} tokens)")
    # Token ids work as prompts too (lists or NumPy arrays), and n choices per prompt sample apart.
    ids = llm.get_tokenizer()("Once upon a time")["input_ids"]
    sampled = portattn.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, n=2, seed=0)
    for choice in llm.generate([ids], sampled, use_tqdm=False)[0].outputs:
        print(f"choice {choice.index}: {choice.text!r} (finish: {choice.finish_reason})")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as root:
            main(save_tiny_chat_checkpoint(f"{root}/tiny-chat"))
