"""What the speculative-decoding tests share: an oracle proposer whose proposals are known to be
right or wrong, and the check that the draft model's pools hold exactly what its sequences say."""

from __future__ import annotations

from collections import Counter

# Speculation at every batch size (the default pauses it above 8 running sequences).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
}


class OracleProposer:
    """Proposes the continuation a plain run produced (``want``: prompt -> output tokens), with one
    wrong token at a position that depends on the request and the step (sometimes none), so that
    steps accept every proposal, some, or none."""

    def __init__(self, want: dict, vocab_size: int, wrong: bool = True, key=lambda seq: tuple(seq.prompt_token_ids)):
        self.want, self.vocab_size, self.wrong, self.key = want, vocab_size, wrong, key
        self.proposals = 0

    def propose(self, requests):
        out = []
        for seq, k in requests:
            full = self.want[self.key(seq)]
            j = seq.num_output_tokens
            tokens = list(full[j : j + k])
            wrong = (5 * j + seq.num_prompt_tokens) % (k + 2) if self.wrong else k
            if wrong < len(tokens):
                tokens[wrong] = (tokens[wrong] + 1) % self.vocab_size
            self.proposals += 1
            out.append((tokens, None))
        return out

    def release(self, live):
        pass


def use_oracle(llm, prompts, outputs, wrong: bool = True) -> OracleProposer:
    """Replace ``llm``'s proposer by an oracle of ``outputs`` (one per prompt, as ``generate`` returns);
    ``wrong=False``: every proposal right."""
    want = {tuple(out.prompt_token_ids): out.token_ids for out in outputs}
    oracle = OracleProposer(want, llm.engine.vocab_size, wrong)
    llm.engine.speculator.proposer = oracle
    return oracle


def assert_draft_pools_consistent(proposer) -> None:
    """The draft model's pages and request rows are held exactly by its live shadows and its cache."""
    alloc, pages, rows = proposer.allocator, proposer.pages, proposer.req_pool
    holders = Counter(p for seq in proposer.shadows.values() for p in seq.pages) + Counter(pages.cache.values())
    assert [alloc.ref_count(p) for p in range(alloc.num_pages)] == [holders[p] for p in range(alloc.num_pages)]
    assert sorted(alloc._free) == [p for p in range(alloc.num_pages) if holders[p] == 0]
    held = [seq.req_pool_idx for seq in proposer.shadows.values()]
    assert sorted(rows._free + held + [proposer.runner.scratch_row]) == list(range(rows.req_to_token.shape[0]))
