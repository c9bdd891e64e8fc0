"""What one engine step did, for step hooks (:meth:`Engine.add_step_hook`): :class:`StepInfo`.

Built only while a hook is registered (an engine without hooks pays nothing); hooks run on the
thread that steps the engine, right after the step, and must be quick (one that raises is
logged and removed).
"""
from __future__ import annotations

from dataclasses import dataclass


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
