"""Continuous-batching scheduler: decode-first, chunked prefill, preemption by recompute.

Each :meth:`Scheduler.schedule` call plans one engine step under two limits:
``max_num_batched_tokens`` (tokens computed in the step) and ``max_num_seqs``
(sequences holding KV blocks). Order:

1. running sequences, oldest first: one token for a decoding sequence, the next chunk
   for one still in (chunked) prefill;
2. waiting sequences, first come first served, as far as budget, sequence cap and free
   blocks allow; a long prompt is split into chunks across steps.

When a running sequence needs a block and none is free, the newest running sequence
is preempted: its blocks are freed and it returns to the front of the queue, to be
recomputed later from its prompt and the tokens it already produced (so it finishes
with the same output). A sequence that cannot fit even alone fails with a clear error.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .kv_cache import BlockAllocator
from .sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues and return its blocks to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- planning ---------------------------------------------------------
    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.metrics.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victims = [s for s in self.running if s.request_id not in scheduled_ids]
                victim = max(victims, key=lambda s: s.metrics.arrival)
                if victim is seq and len(self.running) == 1 and not plan.scheduled:
                    plan.failed.append((seq, self._too_big(seq.num_computed + n)))
                    self.running.remove(seq)
                    # free its blocks now, so the waiting loop below can admit the next request
                    self.allocator.free(seq.block_table)
                    seq.block_table = []
                    break
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq in self.running:
                plan.scheduled.append(ScheduledSeq(seq, n))
                scheduled_ids.add(seq.request_id)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if not self._grow(seq, seq.num_computed + n):
                if not self.running and not plan.scheduled:
                    self.waiting.popleft()
                    plan.failed.append((seq, self._too_big(seq.num_computed + n)))
                    continue
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return plan

    def _too_big(self, num_tokens: int) -> str:
        return (f"KV cache exhausted: this request needs {self.blocks_needed(num_tokens)} blocks of "
                f"{self.block_size} tokens and the whole pool has {self.allocator.num_blocks}. "
                "Raise kv_cache_memory / num_kv_blocks or shorten the prompt / max_new_tokens.")
