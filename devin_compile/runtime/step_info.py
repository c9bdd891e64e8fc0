"""What one engine step did, for step hooks (:meth:`Engine.add_step_hook`): :class:`StepInfo`.

Built only while a hook is registered (an engine without hooks pays nothing); hooks run on the
thread that steps the engine, right after the step, and must be quick (one that raises is
logged and removed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .output_processor import Emission
    from .step_plan import ScheduledSeq


@dataclass(frozen=True)
class StepInfo:
    index: int  # 1 for the engine's first step
    start: float  # perf_counter seconds: step() entered ...
    end: float  # ... and its outputs built
    request_ids: tuple[str, ...]  # the requests the step ran, in batch order
    request_tokens: tuple[int, ...]  # tokens each of them computed (a drafted one: 1 + its proposals)
    prefill_tokens: int  # prompt tokens computed (sequences still in their prompt)
    decode_tokens: int  # decoding sequences (one token each, proposals not counted)
    drafted_tokens: int  # speculative proposals verified
    accepted_tokens: int  # of them, accepted

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @classmethod
    def of(cls, index: int, start: float, end: float, scheduled: Sequence["ScheduledSeq"],
           emitted: Sequence["Emission"]) -> "StepInfo":
        """The StepInfo of a step that ran ``scheduled`` and produced ``emitted``."""
        return cls(
            index=index, start=start, end=end,
            request_ids=tuple(it.seq.request_id for it in scheduled),
            request_tokens=tuple(it.num_tokens + len(it.draft) for it in scheduled),
            prefill_tokens=sum(it.num_tokens for it in scheduled if it.num_tokens > 1),
            decode_tokens=sum(1 for it in scheduled if it.num_tokens == 1),
            drafted_tokens=sum(len(it.draft) for it in scheduled),
            accepted_tokens=sum(len(e.tokens) - 1 for e in emitted if e.drafted and e.tokens))
