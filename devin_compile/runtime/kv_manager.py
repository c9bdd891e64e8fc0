"""KVManager: which KV blocks each sequence holds — the pool's allocator, the prefix cache,
the KV tiers below the pool, and every sequence's chain of block hashes.

The scheduler decides who runs and how many tokens; this decides with which blocks. It
answers three questions for it: can a running sequence :meth:`grow` by n tokens, how would a
waiting one be admitted (:meth:`plan_admission`: cached blocks to start from, blocks found in
the tiers, blocks to allocate), and it carries the admission out (:meth:`admit`). The engine
calls :meth:`commit` after a step (register the blocks that became full), speculation calls
:meth:`rollback` (drop rejected proposals' slots), and :meth:`free` / :meth:`remove` give a
sequence's blocks back.

Prefix caching (``prefix_caching=True``): a waiting sequence starts from the longest trusted run
of cached full blocks of its known tokens (prompt plus, after a preemption, its output so far),
at most ``(num_tokens - 1) // block_size`` blocks so that at least one token is computed and the
step yields logits, and none past the prompt positions a ``prompt_logprobs`` request has scored
(it needs their logits). Those blocks are shared (reference count + 1) and count as computed. A block
computed twice (identical prompts admitted together) is folded onto the registered copy at commit.

KV tiers (:class:`~devin_compile.runtime.kv_tiers.KVTiers`): after the pool's match, the next
blocks of the chain are looked up in the tiers, once the sequence is sure to be admitted, and as
many as the free blocks allow are copied into fresh blocks; they count as computed and are
registered at once. Blocks registered from computed tokens go to the write-through tiers at once
(:meth:`KVTiers.register`); blocks the pool evicts are published to the others.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence as Seq

from .kv_cache import BlockAllocator
from .prefix_cache import ROOT, CachedBlock, PrefixCache, PrefixChain
from .sequence import Sequence

if TYPE_CHECKING:
    from .kv_tiers import KVTiers
    from .state_pool import StatePool
    from .step_plan import ScheduledSeq


@dataclass
class AdmissionPlan:
    """How a waiting sequence would be admitted this step (see :meth:`KVManager.plan_admission`)."""

    fits: bool  # False: the pool cannot hold it now (nothing was looked up or taken)
    num_tokens: int  # tokens the admitting step computes
    new_blocks: int = 0  # blocks to allocate after the cached ones
    hits: list[int] = field(default_factory=list)  # cached blocks it starts from
    entries: list[int] = field(default_factory=list)  # their prefix-cache entry ids
    loaded: list = field(default_factory=list)  # K/V of the following blocks, found in the tiers
    hit_tokens: int = 0  # tokens the cached blocks hold


class KVManager:
    """Blocks of the paged KV pool for sequences (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True,
                 tiers: "KVTiers | None" = None, states: "StatePool | None" = None) -> None:
        if tiers is not None and not prefix_caching:
            raise ValueError("kv_tiers need prefix caching on and must be built over this runner's KV pool")
        if states is not None and prefix_caching:
            raise ValueError("prefix caching cannot serve a model with recurrent layers: a cached block holds "
                             "K/V but not the recurrent state after it; build the KVManager with prefix_caching=False")
        self.states = states  # recurrent layers' state pool: one slot per admitted sequence (None: no such layers)
        self.block_size = block_size
        self.prefix_cache = PrefixCache(block_size) if prefix_caching else None
        self.tiers = tiers
        self.allocator = BlockAllocator(num_blocks, self.prefix_cache,
                                        on_evict=tiers.publish if tiers is not None else None)
        self._chains: dict[str, PrefixChain] = {}  # request id → its walk along the prefix cache

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def pool_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.allocator.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- a sequence's life ------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Start tracking ``seq`` (its chain of block hashes, when prefix caching is on)."""
        if self.prefix_cache is not None:
            self._chains[seq.request_id] = PrefixChain()

    def remove(self, seq: Sequence) -> None:
        """``seq`` is done: its blocks go back to the pool and its chain is forgotten."""
        self.free(seq)
        self._chains.pop(seq.request_id, None)

    def free(self, seq: Sequence) -> None:
        """Give ``seq``'s blocks and state slot back (preemption: it will be recomputed; its hashes are kept)."""
        if self.states is not None and seq.state_slot >= 0:
            self.states.free(seq.state_slot)
            seq.state_slot = -1
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []
        seq.num_evicted, seq.kv_prune_state = 0, None  # KV pruning restarts with the recompute
        chain = self._chains.get(seq.request_id)
        if chain is not None:
            chain.reset()

    def grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens (they take slots, which lag positions after KV pruning);
        False, taking nothing, when the pool has too few free."""
        need = self.blocks_needed(seq.num_slots + n) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        seq.block_table.extend(self.allocator.allocate(need, after=seq.block_table[-1] if seq.block_table else None))
        return True

    # -- admission --------------------------------------------------------------
    def plan_admission(self, seq: Sequence, budget: int) -> AdmissionPlan:
        """How waiting ``seq`` would start, computing at most ``budget`` tokens: the cached blocks it
        matches, then (only when it fits) the tiers' blocks, as many as the free blocks allow."""
        hits, entries = self._match(seq)
        hit_tokens = len(hits) * self.block_size
        n = min(seq.num_tokens - hit_tokens, budget)
        need = self.blocks_needed(hit_tokens + n) - len(hits)
        revive = sum(1 for b in hits if self.allocator.is_free(b))  # cached free blocks taken back
        no_slot = self.states is not None and seq.state_slot < 0 and self.states.num_free == 0
        if no_slot or not self.allocator.can_allocate(need + revive):
            return AdmissionPlan(False, n, hit_tokens=hit_tokens)
        loaded = self._tier_lookup(seq, len(hits))
        while loaded:  # take as many found blocks as the free blocks allow (none: as planned above)
            tier_tokens = len(loaded) * self.block_size
            n_l = min(seq.num_tokens - hit_tokens - tier_tokens, budget)
            need_l = self.blocks_needed(hit_tokens + tier_tokens + n_l) - len(hits)
            if self.allocator.can_allocate(need_l + revive):
                n, need = n_l, need_l
                break
            loaded.pop()
        return AdmissionPlan(True, n, need, hits, entries, loaded, hit_tokens)

    def admit(self, seq: Sequence, plan: AdmissionPlan) -> None:
        """Carry out a fitting ``plan``: share the hits, allocate, install the tiers' blocks, take a state slot."""
        if self.states is not None and seq.state_slot < 0:
            seq.state_slot = self.states.allocate(seq.request_id)
        if plan.hits:
            for b in plan.hits:  # take the hits before allocating, so allocation cannot evict them
                self.allocator.acquire(b)
            seq.block_table = list(plan.hits)
            seq.num_computed = plan.hit_tokens
            seq.metrics.prefix_hit_tokens += plan.hit_tokens
            self._chains[seq.request_id].entries = plan.entries
        if self.prefix_cache is not None:
            self.prefix_cache.stats.query_tokens += seq.num_tokens
            self.prefix_cache.stats.hit_tokens += plan.hit_tokens
        last = seq.block_table[-1] if seq.block_table else None
        seq.block_table.extend(self.allocator.allocate(plan.new_blocks, after=last))
        if plan.loaded:
            self._install(seq, len(plan.hits), plan.loaded)

    def _match(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks (and their entry ids) a waiting ``seq`` can start from; none without a cache."""
        if self.prefix_cache is None:
            return [], []
        max_blocks = self._max_hit_blocks(seq)
        if max_blocks <= 0:
            return [], []
        return self.prefix_cache.match(self._chains[seq.request_id], seq.all_ids, max_blocks)

    def _max_hit_blocks(self, seq: Sequence) -> int:
        """Known blocks a waiting ``seq`` may start from: at least one token is left to compute, and a
        request scoring its prompt (``prompt_logprobs``) takes none past the positions it has scored,
        whose logits it still needs (runtime/prompt_logprobs.py)."""
        n = (seq.num_tokens - 1) // self.block_size
        if not seq.prompt_scored:
            n = min(n, len(seq.prompt_logprobs) // self.block_size)
        return n

    def _tier_lookup(self, seq: Sequence, start: int) -> list:
        """K/V of the chain blocks after the ``start`` the pool matched, as far as the tiers hold them."""
        if self.tiers is None:
            return []
        max_blocks = self._max_hit_blocks(seq)
        hashes = self._chains[seq.request_id].hashes[start:max_blocks]
        if not hashes or self.prefix_cache.get(hashes[0]) is not None:
            return []  # nothing to look up, or the pool has the hash for other content (a collision)
        return self.tiers.lookup(hashes)

    def _install(self, seq: Sequence, start: int, loaded: list) -> None:
        """Write blocks found in the tiers after ``seq``'s first ``start`` blocks; count them computed
        and register them like computed blocks."""
        self.tiers.write(seq.block_table[start:start + len(loaded)], loaded)
        tokens = len(loaded) * self.block_size
        seq.num_computed += tokens
        seq.metrics.tier_hit_tokens += tokens
        self.commit(seq, write_through=False)  # a tier has them

    # -- after a step -------------------------------------------------------------
    def commit(self, seq: Sequence, *, write_through: bool = True) -> None:
        """After a step computed ``seq``'s tokens: register its blocks that just became full (and
        hand the newly registered ones to the tiers' write-through)."""
        cache = self.prefix_cache
        if cache is None or seq.status.done:
            return
        chain = self._chains.get(seq.request_id)
        full = seq.num_computed // self.block_size
        if chain is None or chain.broken or full <= len(chain.entries):
            return
        tokens = seq.all_ids
        cache.hash_blocks(chain, tokens, full)
        new: list[CachedBlock] = []
        for j in range(len(chain.entries), full):
            if not self._register(seq, chain, j, tokens[j * self.block_size:(j + 1) * self.block_size], new):
                break
        if new and write_through and self.tiers is not None:
            self.tiers.register(new)

    def _register(self, seq: Sequence, chain: PrefixChain, j: int, block_tokens: list[int],
                  new: list[CachedBlock]) -> bool:
        """Register ``seq``'s full block ``j`` (appended to ``new``) or fold it onto the registered
        copy; False when the hash is taken by other content, which ends the chain's registration."""
        cache, table = self.prefix_cache, seq.block_table
        parent = chain.entries[-1] if chain.entries else ROOT
        e = cache.get(chain.hashes[j])
        if e is None:
            e = cache.insert(table[j], chain.hashes[j], parent, block_tokens, publish=seq.kv_prune_config is None)
            new.append(e)
        elif not cache.trusted(e, parent, block_tokens):
            cache.stats.rejected += 1
            chain.broken = True
            return False
        elif e.block != table[j]:  # computed twice (admitted together): share the registered copy
            self.allocator.acquire(e.block)
            self.allocator.free([table[j]])
            table[j] = e.block
            cache.stats.deduplicated += 1
        chain.entries.append(e.id)
        return True

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

    def stop_registration(self, seq: Sequence) -> None:
        """KV pruning compacted ``seq``: its blocks no longer hold its tokens in order, so register no more."""
        chain = self._chains.get(seq.request_id)
        if chain is not None:
            chain.broken = True

    def chain_entries(self, seq: Sequence) -> list[int] | None:
        """The prefix-cache entry ids ``seq``'s leading blocks are known to equal (None: not tracked)."""
        chain = self._chains.get(seq.request_id)
        return None if chain is None else chain.entries

    # -- checks, borrowing, stats ---------------------------------------------------
    def check_writes(self, scheduled: Seq["ScheduledSeq"]) -> None:
        """Debug: assert that no slot this step writes lies in a shared or registered block."""
        bs = self.block_size
        for item in scheduled:
            seq = item.seq
            s0 = seq.num_slots  # first slot written (KV pruning: slots != positions)
            first, last = s0 // bs, (s0 + item.num_tokens + item.lookahead - 1) // bs
            for j in range(first, last + 1):
                self.allocator.check_writable(seq.block_table[j])

    @contextmanager
    def borrow(self, num_tokens: int) -> Iterator[list[int]]:
        """Blocks for ``num_tokens`` outside any request (a full-sequence forward), freed after."""
        blocks = self.allocator.allocate(self.blocks_needed(num_tokens))
        try:
            yield blocks
        finally:
            self.allocator.free(blocks)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the tiers' write-through thread, storing what it has queued (at most ``timeout_s``)."""
        if self.tiers is not None:
            self.tiers.drain(timeout_s)

    def evict_cached(self) -> int:
        """Forget every cached block no request holds; returns how many were dropped."""
        return self.allocator.evict_cached()

    def too_big(self, num_tokens: int) -> str:
        """Why a request of ``num_tokens`` can never be admitted, and the way out."""
        return (f"KV cache exhausted: this request needs {self.blocks_needed(num_tokens)} blocks of "
                f"{self.block_size} tokens and the whole pool has {self.allocator.num_blocks}. "
                "Raise kv_cache_memory / num_kv_blocks or shorten the prompt / max_new_tokens.")

    def stats(self) -> dict:
        """Pool occupancy, prefix-cache counters and the tiers' (one dict per tier)."""
        a = self.allocator
        stats = {
            "blocks_total": a.num_blocks, "blocks_used": a.num_used, "blocks_free": a.num_free,
            "blocks_used_peak": a.peak_used,
            "prefix_caching": self.prefix_cache is not None,
            "blocks_cached": 0, "blocks_cached_free": 0,
            "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "prefix_hit_rate": 0.0,
            "prefix_evictions": 0, "prefix_rejected": 0, "prefix_deduplicated": 0,
        }
        if self.prefix_cache is not None:
            ps = self.prefix_cache.stats
            stats.update({
                "blocks_cached": len(self.prefix_cache), "blocks_cached_free": a.num_cached_free,
                "prefix_query_tokens": ps.query_tokens, "prefix_hit_tokens": ps.hit_tokens,
                "prefix_hit_rate": (ps.hit_tokens / ps.query_tokens) if ps.query_tokens else 0.0,
                "prefix_evictions": ps.evictions, "prefix_rejected": ps.rejected,
                "prefix_deduplicated": ps.deduplicated,
            })
        if self.tiers is not None:
            stats.update(self.tiers.stats())
        return stats
