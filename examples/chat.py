"""A conversation through the checkpoint's chat template, whole and streamed.

python examples/chat.py MODEL   # an instruct checkpoint directory or cached model id
python examples/chat.py         # a tiny random chat checkpoint made here (gibberish replies)
"""

from __future__ import annotations

import sys
import tempfile

import portattn
from portattn.testing import save_tiny_chat_checkpoint


def main(model: str) -> None:
    llm = portattn.LLM(model, max_model_len=1024)
    params = portattn.SamplingParams(temperature=0.0, max_tokens=32)
    conversation = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    reply = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    print(f"assistant: {reply!r}")

    # The next turn, streamed: each engine step yields the new text of every request that advanced.
    conversation += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And paged attention?"},
    ]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own BOS
    print("assistant (streamed): ", end="", flush=True)
    for delta in llm.stream([ids], params):
        print(delta.outputs[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as root:
            main(save_tiny_chat_checkpoint(f"{root}/tiny-chat"))
