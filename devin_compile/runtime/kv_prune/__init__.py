"""Dynamic KV-cache pruning: attention scores → eviction policy → compaction → freed pages.

Flow of one pure-decode step (the ``decode`` graph, which carries one ``devin::kv_prune``
node after each ``devin::paged_attention``, see ``passes/insert_kv_prune.py``):

1. :meth:`KVPruner.begin` (engine, before the forward) picks the sequences that prune, bumps
   their step counters and decides which of them *evaluate* this step (every
   ``step_interval`` decode steps). It returns a :class:`PruneStep`, installed in the step
   context (``StepContext.kv_prune``); with no pruning sequence it returns None and the ops
   do nothing beyond one attribute check.
2. ``devin::paged_attention`` asks a backend that can (``forward_with_scores``) for the
   attention-mass side output; ``devin::kv_prune`` (layer ``l``) takes it, or recomputes it
   on evaluation steps, and folds it into each sequence's score accumulator
   (:meth:`PruneStep.accumulate`).
3. :meth:`KVPruner.finish` (engine, after the forward) evaluates: policy, then compaction.

One concern per module:

- :mod:`.switch`: whether a request prunes (``enable_kv_pruning``, ``resolve_request``);
- :mod:`.scores`: per-sequence score accumulators (:class:`PruneState`) and one step's plan
  (:class:`PruneStep`);
- :mod:`.policy`: which tokens each layer evicts;
- :mod:`.compaction`: moving kept tokens into the holes and giving pages back, through
  :class:`~devin_compile.runtime.kv_cache.BlockAllocator` / ``PagedKVCache`` methods;
- :mod:`.stats`: counters; :mod:`.pruner`: :class:`KVPruner`, which drives the others.
"""
from .compaction import compact
from .policy import choose_evictions, eviction_count, pool_by_position
from .pruner import KVPruner
from .scores import PruneState, PruneStep
from .stats import PruneTotals
from .switch import active_config, enable_kv_pruning, resolve_request

__all__ = [
    "KVPruner", "PruneState", "PruneStep", "PruneTotals", "active_config", "choose_evictions", "compact",
    "enable_kv_pruning", "eviction_count", "pool_by_position", "resolve_request",
]
