"""A client of ``portattn serve`` through the official OpenAI client (pip install openai).

portattn serve --model MODEL --served-model-name m --port 8000     # in another shell
python examples/serving_client.py [BASE_URL]                       # default http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import sys

from openai import OpenAI


def main(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused")  # --api-key KEY on the server makes this matter
    model = client.models.list().data[0].id
    print(f"model: {model}")
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
    print(f"completion: {completion.choices[0].text!r} ({completion.usage.completion_tokens} tokens)")
    print("chat (streamed): ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=16, temperature=0, stream=True
    )
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1")
