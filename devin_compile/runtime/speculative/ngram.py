"""N-gram (prompt lookup) proposer: no model, the sequence's own tokens are the draft.

For the longest suffix of ``max_ngram`` down to ``min_ngram`` tokens that occurred earlier in
the sequence (prompt and output), the tokens that followed its latest earlier occurrence are
proposed. Deterministic: q is one-hot, so rejection sampling accepts a proposal x with
probability p(x).
"""
from __future__ import annotations

import torch

from .proposer import Draft, DraftRequest


def lookup(tokens: torch.Tensor, k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    n = tokens.numel()
    for g in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        suffix = tokens[n - g:]
        windows = tokens[:n - 1].unfold(0, g, 1)  # windows ending before the last token
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + g
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            toks = torch.tensor(r.seq.all_ids, dtype=torch.long)
            out.append(Draft(lookup(toks, r.num_tokens, self.min_ngram, self.max_ngram)))
        return out

    def release(self, seq) -> None:
        pass
