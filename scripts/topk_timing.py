"""The top-k draw's parts on a GPU: ``torch.topk`` over a Llama 3 vocabulary (128,256 scores a row) at
several k, and the nucleus draw (top-p 0.95, temperature 0.8) with top-k 50 / 1000 / none, the k-th
largest score from ``torch.topk`` (``top_k_cap`` 256 and 1024) or searched in the kernel (cap 0), each checked
token for token against the torch code. Graph replays, median ms; batches 1 and 64.

    PYTHONPATH=src python3 scripts/topk_timing.py
"""

import torch

from portattn.bench.timing import measure_graph
from portattn.engine import sampler
from portattn.kernels.triton.fused_launch import nucleus


def main() -> None:
    dev = torch.device("cuda")
    for b in (1, 64):
        x = torch.randn(b, 128256, device=dev) * 3
        for k in (64, 256, 1024):
            t = measure_graph(lambda _, k=k, x=x: torch.topk(x, k, dim=-1), [0, 1], dev)
            print(f"topk B={b} k={k}: {t.median_ms:.4f} ms")
        temp = torch.full((b,), 0.8, device=dev)
        top_p = torch.full((b,), 0.95, device=dev)
        words = sampler.row_words(torch.arange(b, device=dev) * 7919, torch.zeros(b, dtype=torch.int64, device=dev))
        args = (x, temp, top_p, words, torch.zeros(b, dtype=torch.bool, device=dev))
        for k, cap in ((50, 256), (50, 1024), (50, 0), (1000, 256), (1000, 1024), (0, 256)):
            top_k = None if k == 0 else torch.full((b,), k, dtype=torch.int64, device=dev)

            def draw(_, top_k=top_k, cap=cap, args=args):
                return nucleus(*args, divide=True, rounds=sampler.NUCLEUS_ROUNDS, top_k=top_k, top_k_cap=cap)

            same = torch.equal(draw(0), sampler.nucleus_draw(*args, divide=True, top_k=top_k))
            t = measure_graph(draw, [0, 1], dev)
            print(f"nucleus B={b} top_k={k} cap={cap}: {t.median_ms:.4f} ms, equal to torch: {same}")


if __name__ == "__main__":
    main()
