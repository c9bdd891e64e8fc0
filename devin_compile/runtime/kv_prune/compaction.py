"""Compaction: drop evicted slots, move kept tokens into the holes, give pages back.

Decode attends to every slot below ``seq_len``, so slot order within a sequence is free:
kept tokens from the tail ``[m, n)`` (``m = n - count``) move into the holes left in
``[0, m)``, per layer (few moves in steady state, no full rewrite). Slots keep their true
rotary positions (baked into K) and new tokens continue from the true position
(``Sequence.num_evicted`` separates slots from positions). Blocks at and past
``ceil(m / block_size)`` go back to the allocator. A block about to be written (a hole or
the next append) that is shared (reference count > 1) is first copied to a fresh block (if
no block is free the evaluation is skipped); one registered in the prefix cache is copied
too while spare blocks last, so its entry keeps serving later hits, else unregistered (its
content no longer matches its hash). The caller then stops the sequence registering blocks.
Unchanged blocks stay shared and registered.

Every change to the pool goes through :class:`~devin_compile.runtime.kv_cache.BlockAllocator`
(``release_tail``, ``copy_on_write``, ``unregister``) and
:class:`~devin_compile.runtime.kv_cache.PagedKVCache` (``gather_slots``, ``scatter_slots``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .scores import PruneState
from .stats import PruneTotals

if TYPE_CHECKING:
    from ..kv_cache import BlockAllocator, PagedKVCache
    from ..sequence import Sequence


def blocks_written(hole_slots: torch.Tensor, m: int, block_size: int) -> list[int]:
    """Block-table indices compaction writes: those holding a hole, and the one the next token goes to."""
    written = set((hole_slots // block_size).unique().tolist())
    if m % block_size:
        written.add(m // block_size)  # the next token is appended there
    new_nb = (m + block_size - 1) // block_size
    return sorted(j for j in written if j < new_nb)


def compact(seq: "Sequence", evict: torch.Tensor, allocator: "BlockAllocator", kv_cache: "PagedKVCache",
            totals: PruneTotals) -> bool:
    """Drop the slots marked in ``evict`` ([layers, n] bool, the same count per layer) and free pages.

    Returns False (and changes nothing) when a needed copy-on-write finds no free block.
    """
    st: PruneState = seq.kv_prune_state
    bs = kv_cache.block_size
    n = evict.shape[1]
    count = int(evict[0].sum())
    if count == 0:
        return True
    if not bool((evict.sum(dim=1) == count).all()):
        raise RuntimeError("kv_prune: every layer must evict the same number of slots")
    m = n - count
    keep = ~evict
    hole_l, hole_s = (~keep[:, :m]).nonzero(as_tuple=True)  # row-major: by layer, then slot
    tail_l, tail_s = keep[:, m:].nonzero(as_tuple=True)
    tail_s = tail_s + m
    table = list(seq.block_table)
    new_nb = (m + bs - 1) // bs
    written = blocks_written(hole_s, m, bs)
    shared = [j for j in written if allocator.is_shared(table[j])]
    registered = [j for j in written if not allocator.is_shared(table[j]) and allocator.is_registered(table[j])]
    trailing = table[new_nb:]
    spare = allocator.num_free + allocator.num_freed_by(trailing)
    if len(shared) > spare:
        totals.skipped_no_space += 1
        return False
    keep_registered = set(registered[:spare - len(shared)])  # copy these too, so their cache entries live on
    moved = kv_cache.gather_slots(tail_l, kv_cache.slot_ids(table, tail_s))  # before any block is reused
    freed = allocator.release_tail(trailing)  # a shared one only loses our reference
    for j in written:
        b = table[j]
        if allocator.is_shared(b):  # copy, never edit in place
            table[j] = allocator.copy_on_write(b, kv_cache)
            totals.copied_blocks += 1
        elif j in keep_registered:  # ours alone and cached: copy, so the entry keeps serving hits
            table[j] = allocator.copy_on_write(b, kv_cache)
            totals.copied_cached_blocks += 1
        elif allocator.is_registered(b):  # ours alone, registered, no spare block: its hash no longer holds
            allocator.unregister(b)
            totals.unregistered_blocks += 1
    kv_cache.scatter_slots(hole_l, kv_cache.slot_ids(table, hole_s), moved)
    st.move_slots(hole_l, hole_s, tail_l, tail_s, m)
    seq.block_table = table[:new_nb]
    seq.num_evicted += count
    seq.metrics.kv_evicted_tokens += count
    seq.metrics.kv_freed_blocks += freed
    totals.evicted_tokens += count
    totals.freed_blocks += freed
    return True
