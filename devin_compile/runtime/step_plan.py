"""One step's plan, as the scheduler hands it to the engine: :class:`StepPlan` of :class:`ScheduledSeq`."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed
    lookahead: int = 0  # KV slots reserved after them for proposals (speculative decoding)
    draft: list[int] = field(default_factory=list)  # the proposals verified this step (<= lookahead)
    draft_probs: object = None  # the proposer's q [len(draft), vocab], or None (one-hot)


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_decode(self) -> bool:
        """Every scheduled sequence computes one token (a pure decode step)."""
        return all(item.num_tokens == 1 for item in self.scheduled)
