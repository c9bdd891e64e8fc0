"""KV pruning counters, engine-wide (:class:`PruneTotals`) and as ``Engine.kv_stats()`` keys."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PruneTotals:
    evaluations: int = 0
    evicted_tokens: int = 0
    freed_blocks: int = 0
    copied_blocks: int = 0  # shared blocks (reference count > 1) copied before compaction wrote to them
    copied_cached_blocks: int = 0  # registered blocks of ours alone copied, so the prefix cache keeps them
    unregistered_blocks: int = 0  # prefix-cache entries dropped because compaction changed them
    skipped_no_space: int = 0  # evaluations skipped: no free block for a copy-on-write

    def as_stats(self, live_tokens: int) -> dict:
        """The ``kv_prune_*`` keys of ``Engine.kv_stats()`` (+ ``kv_live_tokens``: slots of running requests)."""
        return {"kv_prune_evaluations": self.evaluations, "kv_prune_evicted_tokens": self.evicted_tokens,
                "kv_prune_freed_blocks": self.freed_blocks, "kv_prune_copied_blocks": self.copied_blocks,
                "kv_prune_copied_cached_blocks": self.copied_cached_blocks,
                "kv_prune_unregistered_blocks": self.unregistered_blocks,
                "kv_prune_skipped_no_space": self.skipped_no_space, "kv_live_tokens": live_tokens}
