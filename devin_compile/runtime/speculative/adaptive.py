"""How many tokens a request proposes next: :class:`SpecState` (one per speculating request).

Rule (``adaptive=True``): after a verify step that accepted every proposal the length grows by
one (up to the configured ``num_tokens``); after one that accepted fewer than half it shrinks by
one (down to 1). When the mean acceptance of the last ``WINDOW`` steps (at least
``MIN_OBSERVED`` of them: a proposer that misses from the start pauses early) drops below
``MIN_RATE`` the request stops proposing for a back-off of steps (1, 2, 4, ... up to
``MAX_BACKOFF``; halved again after a step that accepts), then probes once more. The window
is kept across the pause, so a probe that misses again pauses at once for twice as long: a
proposer that keeps missing costs one probe per back-off (about log2 of the tokens generated),
not a window of them. The engine also caps the
length so that a step's verify tokens stay within ``max_verify_tokens`` (see
:meth:`SpeculativeDecoder.plan`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .stats import SpecMetrics

WINDOW = 4
MIN_OBSERVED = 2
MIN_RATE = 0.25
MAX_BACKOFF = 32


@dataclass
class SpecState:
    proposer: Any  # the proposer pinned at admission (a hot swap leaves it to finish on this one)
    max_tokens: int
    threshold: float
    adaptive: bool
    num_tokens: int = 0
    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    cooldown: int = 0
    backoff: int = 1
    recomputes_in_row: int = 0
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    def __post_init__(self) -> None:
        self.num_tokens = self.max_tokens
        self.metrics.proposer = getattr(self.proposer, "name", type(self.proposer).__name__)
        self.metrics.num_tokens = self.num_tokens

    def wanted(self) -> int:
        """Tokens to propose this step (0 while backing off); counts the back-off down."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        return self.num_tokens

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0 or not self.adaptive:
            return
        self.window.append(accepted / proposed)
        if accepted == proposed:
            self.num_tokens = min(self.num_tokens + 1, self.max_tokens)
        elif 2 * accepted < proposed:
            self.num_tokens = max(self.num_tokens - 1, 1)
        if accepted:
            self.backoff = max(1, self.backoff // 2)
        if len(self.window) >= MIN_OBSERVED and sum(self.window) / len(self.window) < MIN_RATE:
            self.cooldown = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        self.metrics.num_tokens = self.num_tokens
