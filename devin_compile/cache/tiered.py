"""Caches in tiers (host memory, then Redis, ...): look tier by tier, promote hits, evict downward.

- ``get`` asks the tiers in order; a hit in a lower tier is copied into every tier above it
  (promotion), so the next ``get`` is served by the fastest one.
- ``set`` stores into the first tier only (``write_through=True``: into every tier). A tier that
  evicts an entry for room passes it to the next tier (each tier's ``on_evict`` is the next tier's
  ``set``), so an entry leaves the chain only when the last tier drops it or it expires.
  The last tier's ``on_evict`` is left alone (``None`` unless the caller set it). Redis evicts on
  the server and cannot pass entries down, so it belongs last.
- ``invalidate``/``clear`` act on every tier.

Values are expected to be content-addressed (a key's value never changes, as for KV blocks keyed
by their chained hash), so a promotion racing an ``invalidate`` can at worst put the same bytes back.
``stats()`` counts gets/sets at this level (a hit in any tier is a hit) and sums what the tiers
hold and their evictions, expirations and errors; :meth:`TieredCache.tier_stats` has each tier's.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Sequence

from .base import CacheBackend, CacheStats, Key


class TieredCache(CacheBackend):
    """A chain of caches, fastest first, with promotion on hit and write-down on eviction."""

    def __init__(self, tiers: Sequence[CacheBackend], *, write_through: bool = False) -> None:
        self.tiers = list(tiers)
        if not self.tiers:
            raise ValueError("TieredCache needs at least one tier")
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            if upper.on_evict is not None:
                raise ValueError(f"{type(upper).__name__} already passes evictions somewhere (on_evict is set)")
            upper.on_evict = lower.set
        self.write_through = write_through
        self._lock = threading.Lock()
        self._hits = self._misses = self._sets = 0
        self._tier_hits = [0] * len(self.tiers)

    def get(self, key: Key) -> bytes | None:
        for i, tier in enumerate(self.tiers):
            value = tier.get(key)
            if value is not None:
                for upper in reversed(self.tiers[:i]):
                    upper.set(key, value)
                with self._lock:
                    self._hits += 1
                    self._tier_hits[i] += 1
                return value
        with self._lock:
            self._misses += 1
        return None

    def set(self, key: Key, value: bytes, ttl_s: float | None = None) -> bool:
        targets = self.tiers if self.write_through else self.tiers[:1]
        stored = [tier.set(key, value, ttl_s) for tier in targets]
        if any(stored):
            with self._lock:
                self._sets += 1
        return any(stored)

    def invalidate(self, key: Key) -> bool:
        return any([tier.invalidate(key) for tier in self.tiers])

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()

    def stats(self) -> CacheStats:
        total = sum(self.tier_stats(), CacheStats())
        with self._lock:
            return replace(total, hits=self._hits, misses=self._misses, sets=self._sets)

    def tier_stats(self) -> list[CacheStats]:
        """Each tier's own counters (a tier's ``hits`` include gets that tiers above it missed)."""
        return [tier.stats() for tier in self.tiers]

    def hits_by_tier(self) -> list[int]:
        """How many ``get`` calls each tier answered."""
        with self._lock:
            return list(self._tier_hits)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
