"""What a proposer is: something that guesses each sequence's next tokens cheaply.

:class:`Proposer` ``propose(requests)`` gets, for each speculating sequence of a step, the
sequence and how many tokens it may propose, and returns one :class:`Draft` per request: the
proposed tokens and, for a model that sampled them, the distribution each was drawn from
(``probs`` [n, vocab]; None means deterministic, q = one-hot, as for n-gram lookup). A proposer
may propose fewer tokens than asked, or none. ``release(seq)`` forgets a finished sequence.
Proposers never change the target's sequences or KV: the engine verifies and rolls back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..sequence import Sequence


@dataclass
class DraftRequest:
    seq: "Sequence"
    num_tokens: int  # at most this many proposals
    threshold: float = 0.0  # stop when the proposer's own probability of its next token is below this


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] float32: q of each proposal; None: one-hot


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One :class:`Draft` per request (possibly empty)."""
        ...

    def release(self, seq: "Sequence") -> None:
        """``seq`` finished (or failed): drop whatever the proposer keeps for it."""
        ...
