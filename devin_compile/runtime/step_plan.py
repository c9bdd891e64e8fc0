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
    # positions of this chunk whose logits score the next prompt token (SamplingParams.prompt_logprobs,
    # runtime/prompt_logprobs.py); fixed when the step is planned, before num_computed moves
    scored: range = field(init=False, default=range(0))

    def __post_init__(self) -> None:
        seq = self.seq
        if seq.prompt_logprobs is not None:
            start = seq.num_computed
            self.scored = range(max(start, len(seq.prompt_logprobs)),
                                min(start + self.num_tokens, len(seq.prompt_ids) - 1))


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
