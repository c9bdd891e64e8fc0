"""Log-probabilities of emitted tokens: :class:`TokenLogprob` and :func:`token_logprobs`.

As vLLM by default, they are read from the model's raw distribution: ``log_softmax`` of the
logits before logits processors, temperature, top-k and top-p. A request asks for them with
``SamplingParams(logprobs=k)`` (k top alternatives, 0..:data:`MAX_LOGPROBS`); the engine computes
them only for such requests, one entry per output token (verified speculative tokens included,
each from its own verify row).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20
FLOOR = -9999.0  # -inf / NaN are not JSON: a token the model rules out gets this (as vLLM does)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first
    rank: int | None = None  # 1 + how many tokens are more likely (vLLM's rank); None: not computed


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Float32 log-probabilities of logits rows [N, V] (a new tensor: later in-place edits of
    ``logits`` by logits processors do not reach it)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logp: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row i of log-probabilities ``logp`` [N, V] → token ``tokens[i]``'s logprob, its rank and its
    ``ks[i]`` most likely alternatives."""
    if not tokens:
        return []
    logp = logp[:len(tokens)]
    chosen_t = logp.gather(1, torch.tensor(tokens, dtype=torch.long, device=logp.device).unsqueeze(1))
    ranks = ((logp > chosen_t).sum(1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    k = min(max(ks), logp.shape[-1])
    top_v, top_i = (logp.topk(k, dim=-1) if k else (None, None))
    out = []
    for i, tok in enumerate(tokens):
        top = []
        if ks[i]:
            top = [(t, _floor(v)) for t, v in zip(top_i[i, :ks[i]].tolist(), top_v[i, :ks[i]].tolist())]
        out.append(TokenLogprob(tok, _floor(chosen[i]), top, ranks[i]))
    return out


def _floor(v: float) -> float:
    return v if v >= FLOOR else FLOOR  # also NaN
