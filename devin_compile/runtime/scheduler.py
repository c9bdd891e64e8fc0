"""Continuous-batching scheduler: decode-first, chunked prefill, preemption by recompute.

Policy only: who runs in a step and with how many tokens. Which blocks they hold is the
:class:`~devin_compile.runtime.kv_manager.KVManager`'s business (prefix hits, KV tiers, growth).

Each :meth:`Scheduler.schedule` call plans one engine step under two limits:
``max_num_batched_tokens`` (tokens computed in the step) and ``max_num_seqs``
(sequences holding KV blocks). Order:

1. running sequences, oldest first: one token for a decoding sequence, the next chunk
   for one still in (chunked) prefill;
2. waiting sequences, first come first served, as far as budget, sequence cap and free
   blocks allow; a long prompt is split into chunks across steps. With dynamic batching
   (``min_batch_size`` > 1) they join only once enough are waiting or the oldest has
   waited ``max_wait_ms``.

``step_mode="separate"`` makes every step prefill-only (while any prompt work is
pending: a chunk in progress or an admissible waiting request) or decode-only, instead
of mixing both in one step.

When a running sequence needs a block and none is free, the newest running sequence
is preempted: its blocks are freed and it returns to the front of the queue, to be
recomputed later from its prompt and the tokens it already produced (so it finishes
with the same output). A sequence that cannot fit even alone fails with a clear error.
"""
from __future__ import annotations

import time
from collections import deque

from ..config import SchedulerConfig
from .kv_manager import KVManager
from .sequence import Sequence, Status
from .step_plan import ScheduledSeq, StepPlan


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.kv.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues and return its blocks to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.remove(seq)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.metrics.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    # -- dynamic batching ---------------------------------------------------
    def admission_open(self, now: float | None = None) -> bool:
        """Whether waiting requests may join now: ``min_batch_size`` are waiting, or the oldest
        has waited ``max_wait_ms``. Preempted requests (recomputes) never wait."""
        if not self.waiting:
            return False
        cfg = self.config
        if cfg.min_batch_size <= 1 or self.waiting[0].metrics.preemptions:
            return True
        if len(self.waiting) >= cfg.min_batch_size:
            return True
        return self.admission_deadline() <= (time.perf_counter() if now is None else now)

    def admission_deadline(self) -> float:
        """When the oldest waiting request's ``max_wait_ms`` runs out (perf_counter seconds)."""
        oldest = min(s.metrics.arrival for s in self.waiting)
        return oldest + self.config.max_wait_ms / 1e3

    def _prefill_pending(self) -> bool:
        return any(s.in_prefill for s in self.running) or self.admission_open()

    # -- planning ---------------------------------------------------------
    def schedule(self) -> StepPlan:
        if self.config.step_mode != "separate":
            plan = self._schedule(None)
        else:  # separate steps: prefill-only while prompt work is pending, else decode-only
            plan = self._schedule("prefill") if self._prefill_pending() else StepPlan()
            if not (plan.scheduled or plan.failed or plan.preempted):
                plan = self._schedule("decode")  # (no prompt could be admitted: no room, so decode instead)
        now = time.perf_counter()
        for item in plan.scheduled:
            if item.seq.metrics.first_scheduled is None:
                item.seq.metrics.first_scheduled = now
        return plan

    def _schedule(self, phase: str | None) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, phase)
        if phase != "decode" and self.admission_open():
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, phase: str | None) -> int:
        """Running sequences, oldest first, in ``phase`` (None: any); returns the budget left."""
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            if phase is not None and (phase == "prefill") != seq.in_prefill:
                continue
            n = min(seq.num_uncomputed, budget)
            # speculation: room for the proposals a decoding sequence may make (dropped before preempting)
            extra = min(seq.spec_lookahead, budget - n) if n == seq.num_uncomputed == 1 else 0
            extra = self._make_room(seq, n, extra, plan)
            if seq in self.running:
                plan.scheduled.append(ScheduledSeq(seq, n, extra))
                budget -= n + extra
        return budget

    def _make_room(self, seq: Sequence, n: int, extra: int, plan: StepPlan) -> int:
        """Grow ``seq`` by ``n`` (+ ``extra`` proposal slots, dropped first), preempting the newest
        unscheduled sequences as needed; a sequence that cannot fit alone fails. Returns the extra kept."""
        while not self.kv.grow(seq, n + extra):
            if extra:
                extra = 0
                continue
            scheduled = {id(item.seq) for item in plan.scheduled}
            victim = max((s for s in self.running if id(s) not in scheduled), key=lambda s: s.metrics.arrival)
            if victim is seq and len(self.running) == 1 and not plan.scheduled:
                plan.failed.append((seq, self.kv.too_big(seq.num_computed + n)))
                self.running.remove(seq)
                self.kv.free(seq)  # free its blocks now, so the waiting loop can admit the next request
                break
            self._preempt(victim, plan)
            if victim is seq:
                break
        return extra

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """Waiting sequences, first come first served, while budget, sequence cap and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            admission = self.kv.plan_admission(seq, budget)
            if not admission.fits:
                if not self.running and not plan.scheduled:
                    self.waiting.popleft()
                    plan.failed.append((seq, self.kv.too_big(admission.hit_tokens + admission.num_tokens)))
                    continue
                break
            self.kv.admit(seq, admission)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, admission.num_tokens))
            budget -= admission.num_tokens
