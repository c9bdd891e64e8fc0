"""Engine-wide step counters and KV-slot accounting (:class:`EngineMetrics`, :func:`slot_usage`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .sequence import Sequence


@dataclass
class EngineMetrics:
    steps: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    # KV memory accounting, sampled every SLOT_SAMPLE_EVERY steps: live tokens vs allocated slots
    live_slots_sampled: int = 0
    allocated_slots_sampled: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def mean_live_slot_fraction(self) -> float:
        """Over the run: of the KV slots allocated to requests, the fraction holding live tokens."""
        s = self.allocated_slots_sampled
        return self.live_slots_sampled / s if s else 1.0

    def record_step(self, decode: bool, seconds: float, tokens: int,
                    slot_usage: Callable[[], tuple[int, int]]) -> None:
        """One step that ran a batch: its time and tokens (a decode step: tokens emitted; a step with
        prompt work: tokens computed); every SLOT_SAMPLE_EVERY steps, ``slot_usage()`` is sampled."""
        self.steps += 1
        if self.steps % SLOT_SAMPLE_EVERY == 1:
            live, allocated = slot_usage()
            self.live_slots_sampled += live
            self.allocated_slots_sampled += allocated
        if decode:
            self.decode_time += seconds
            self.decode_tokens += tokens
        else:
            self.prefill_time += seconds
            self.prefill_tokens += tokens


SLOT_SAMPLE_EVERY = 8


def slot_usage(seqs: Iterable[Sequence], block_size: int) -> tuple[int, int]:
    """(slots holding live tokens, slots in blocks held by ``seqs``); a shared block counts once."""
    filled: dict[int, int] = {}
    for s in seqs:
        for j, b in enumerate(s.block_table):
            n = max(0, min(block_size, s.num_slots - j * block_size))
            filled[b] = max(filled.get(b, 0), n)
    return sum(filled.values()), len(filled) * block_size
