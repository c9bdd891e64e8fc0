"""Verifying a draft against the target's distributions.

Greedy: accept the longest prefix of the draft that equals the target's argmax, then the
target's own next token (the bonus) — the output equals plain greedy decoding.

Sampled: rejection sampling. Proposal ``x_j`` drawn from ``q_j`` is accepted with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection a token is drawn from the normalised
residual ``max(p_j - q_j, 0)`` and verification stops; when all are accepted the bonus is drawn
from ``p_{d}``. Every emitted token is then distributed as the target's ``p``. A deterministic
proposer has ``q_j`` = one-hot(x_j). All draws use the request's generator (seeded → repeatable).
"""
from __future__ import annotations

import torch


def accept_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """Tokens emitted: the agreeing prefix of ``draft`` plus the target's token after it.
    ``target_argmax`` has ``len(draft) + 1`` entries (the argmax after each draft position)."""
    a = 0
    while a < len(draft) and draft[a] == target_argmax[a]:
        a += 1
    return draft[:a] + [target_argmax[a]]


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """Tokens emitted by rejection sampling. ``p``: target probabilities [len(draft) + 1, V];
    ``q``: the draft's [len(draft), V] (None: one-hot on each proposal)."""
    out: list[int] = []
    for j, x in enumerate(draft):
        px = float(p[j, x])
        qx = 1.0 if q is None else float(q[j, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u < min(1.0, px / qx):
            out.append(x)
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=generator)))
    return out
