"""Continuous-batching scheduler: decode-first, chunked prefill, preemption by recompute.

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

Prefix caching (when the allocator has a :class:`PrefixCache`): a waiting sequence is
admitted with the longest trusted run of cached full blocks of its known tokens (prompt
plus, after a preemption, its output so far), at most ``(num_tokens - 1) // block_size``
blocks so that at least one token is computed and the step yields logits. Those blocks
are shared (reference count + 1) and count as computed; ``metrics.prefix_hit_tokens``
sums them over the request's admissions (a preempted request that hits again counts
again). After each step :meth:`Scheduler.commit` registers the blocks that became full;
a block computed twice (identical prompts admitted together) is folded onto the
registered copy.

KV tiers (:class:`~devin_compile.runtime.kv_tiers.KVTiers`, optional): after the pool's match, the
next blocks of the chain are looked up in the tiers and copied into freshly allocated blocks;
they count as computed (``metrics.tier_hit_tokens``) and are registered at once, like computed
blocks. The lookup runs only once the request is sure to be admitted, and as many found blocks
are taken as the step's free blocks allow.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import SchedulerConfig
from .kv_cache import BlockAllocator
from .prefix_cache import ROOT, PrefixChain
from .sequence import Sequence, Status

if TYPE_CHECKING:
    from .kv_tiers import KVTiers


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
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft) for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 kv_tiers: "KVTiers | None" = None) -> None:
        self.config = config
        self.kv_tiers = kv_tiers
        self.allocator = allocator
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache = allocator.prefix_cache
        self._chains: dict[str, PrefixChain] = {}  # request id → its walk along the prefix cache

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        if self.prefix_cache is not None:
            self._chains[seq.request_id] = PrefixChain()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues and return its blocks to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        self._chains.pop(seq.request_id, None)

    def _free_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []
        seq.num_evicted, seq.kv_prune_state = 0, None  # KV pruning restarts with the recompute
        chain = self._chains.get(seq.request_id)
        if chain is not None:
            chain.reset()

    def stop_prefix_registration(self, seq: Sequence) -> None:
        """KV pruning compacted ``seq``: its blocks no longer hold its tokens in order, so register no more."""
        chain = self._chains.get(seq.request_id)
        if chain is not None:
            chain.broken = True

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- planning ---------------------------------------------------------
    def _grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens (they take slots, which lag positions after KV pruning)."""
        need = self.blocks_needed(seq.num_slots + n) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        seq.block_table.extend(self.allocator.allocate(need, after=seq.block_table[-1] if seq.block_table else None))
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
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

    def schedule(self) -> StepPlan:
        if self.config.step_mode != "separate":
            return self._schedule(None)
        # separate steps: prefill-only while prompt work is pending, else decode-only
        if self._prefill_pending():
            plan = self._schedule("prefill")
            if plan.scheduled or plan.failed or plan.preempted:
                return plan  # (else no prompt could be admitted: no room, so decode instead)
        return self._schedule("decode")

    def _schedule(self, phase: str | None) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
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
            while not self._grow(seq, n + extra):
                if extra:
                    extra = 0
                    continue
                victims = [s for s in self.running if s.request_id not in scheduled_ids]
                victim = max(victims, key=lambda s: s.metrics.arrival)
                if victim is seq and len(self.running) == 1 and not plan.scheduled:
                    plan.failed.append((seq, self._too_big(seq.num_computed + n)))
                    self.running.remove(seq)
                    # free its blocks now, so the waiting loop below can admit the next request
                    self._free_blocks(seq)
                    break
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq in self.running:
                plan.scheduled.append(ScheduledSeq(seq, n, extra))
                scheduled_ids.add(seq.request_id)
                budget -= n + extra
        admit = phase != "decode" and self.admission_open()
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits, entries = self._match(seq)
            hit_tokens = len(hits) * self.block_size
            n = min(seq.num_tokens - hit_tokens, budget)
            need = self.blocks_needed(hit_tokens + n) - len(hits)
            revive = sum(1 for b in hits if self.allocator.is_free(b))  # cached free blocks taken back
            if not self.allocator.can_allocate(need + revive):
                if not self.running and not plan.scheduled:
                    self.waiting.popleft()
                    plan.failed.append((seq, self._too_big(hit_tokens + n)))
                    continue
                break
            loaded = self._tier_lookup(seq, len(hits))
            while loaded:  # take as many found blocks as the free blocks allow (none: as admitted above)
                tier_tokens = len(loaded) * self.block_size
                n_l = min(seq.num_tokens - hit_tokens - tier_tokens, budget)
                need_l = self.blocks_needed(hit_tokens + tier_tokens + n_l) - len(hits)
                if self.allocator.can_allocate(need_l + revive):
                    n, need = n_l, need_l
                    break
                loaded.pop()
            if hits:
                for b in hits:  # take the hits before allocating, so allocation cannot evict them
                    self.allocator.acquire(b)
                seq.block_table = list(hits)
                seq.num_computed = hit_tokens
                seq.metrics.prefix_hit_tokens += hit_tokens
                self._chains[seq.request_id].entries = entries
            if self.prefix_cache is not None:
                self.prefix_cache.stats.query_tokens += seq.num_tokens
                self.prefix_cache.stats.hit_tokens += hit_tokens
            seq.block_table.extend(self.allocator.allocate(need, after=seq.block_table[-1] if seq.block_table else None))
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if loaded:
                self._install(seq, len(hits), loaded)
            plan.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return plan

    # -- prefix caching -----------------------------------------------------
    def _match(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks (and their entry ids) a waiting ``seq`` can start from; none without a cache."""
        if self.prefix_cache is None:
            return [], []
        max_blocks = (seq.num_tokens - 1) // self.block_size  # leave >= 1 token to compute
        if max_blocks <= 0:
            return [], []
        return self.prefix_cache.match(self._chains[seq.request_id], seq.all_ids, max_blocks)

    def _tier_lookup(self, seq: Sequence, start: int) -> list:
        """K/V of the chain blocks after the ``start`` the pool matched, as far as the tiers hold them."""
        if self.kv_tiers is None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size  # leave >= 1 token to compute
        hashes = self._chains[seq.request_id].hashes[start:max_blocks]
        if not hashes or self.prefix_cache.get(hashes[0]) is not None:
            return []  # nothing to look up, or the pool has the hash for other content (a collision)
        return self.kv_tiers.lookup(hashes)

    def _install(self, seq: Sequence, start: int, loaded: list) -> None:
        """Write blocks found in the tiers after ``seq``'s first ``start`` blocks; count them computed
        and register them like computed blocks."""
        self.kv_tiers.write(seq.block_table[start:start + len(loaded)], loaded)
        tokens = len(loaded) * self.block_size
        seq.num_computed += tokens
        seq.metrics.tier_hit_tokens += tokens
        self.commit(seq)

    def rollback(self, seq: Sequence, num_computed: int) -> int:
        """Speculation: ``seq`` keeps the K/V of its first ``num_computed`` tokens only (rejected
        proposals' slots are dropped); blocks past its slots go back to the pool. Returns how many."""
        seq.num_computed = num_computed
        keep = self.blocks_needed(seq.num_slots)
        tail = seq.block_table[keep:]
        if not tail:
            return 0
        del seq.block_table[keep:]
        return self.allocator.release_tail(tail)

    def commit(self, seq: Sequence) -> None:
        """After a step computed ``seq``'s tokens: register its blocks that just became full."""
        cache = self.prefix_cache
        if cache is None or seq.status.done:
            return
        chain = self._chains.get(seq.request_id)
        bs = self.block_size
        full = seq.num_computed // bs
        if chain is None or chain.broken or full <= len(chain.entries):
            return
        tokens = seq.all_ids
        cache.hash_blocks(chain, tokens, full)
        table = seq.block_table
        for j in range(len(chain.entries), full):
            parent = chain.entries[-1] if chain.entries else ROOT
            block_tokens = tokens[j * bs:(j + 1) * bs]
            h = chain.hashes[j]
            e = cache.get(h)
            if e is None:
                e = cache.insert(table[j], h, parent, block_tokens, publish=seq.kv_prune_config is None)
            elif cache.trusted(e, parent, block_tokens):
                if e.block != table[j]:  # computed twice (admitted together): share the registered copy
                    self.allocator.acquire(e.block)
                    self.allocator.free([table[j]])
                    table[j] = e.block
                    cache.stats.deduplicated += 1
            else:  # the hash is taken by other content: this chain cannot be registered further
                cache.stats.rejected += 1
                chain.broken = True
                return
            chain.entries.append(e.id)

    def check_writes(self, plan: StepPlan) -> None:
        """Debug hook: assert that no slot this step writes lies in a shared or registered block."""
        bs = self.block_size
        for item in plan.scheduled:
            seq = item.seq
            s0 = seq.num_slots  # first slot written (KV pruning: slots != positions)
            first, last = s0 // bs, (s0 + item.num_tokens + item.lookahead - 1) // bs
            for j in range(first, last + 1):
                self.allocator.check_writable(seq.block_table[j])

    def _too_big(self, num_tokens: int) -> str:
        return (f"KV cache exhausted: this request needs {self.blocks_needed(num_tokens)} blocks of "
                f"{self.block_size} tokens and the whole pool has {self.allocator.num_blocks}. "
                "Raise kv_cache_memory / num_kv_blocks or shorten the prompt / max_new_tokens.")
