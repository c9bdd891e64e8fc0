"""In-process cache bounded by bytes, evicting the least recently used entry.

Size of an entry = ``len(key) + len(value)`` in bytes; ``stats().bytes`` never exceeds
``max_bytes`` after a call returns. ``get`` and ``set`` make an entry the most recent. A value
larger than ``max_bytes`` is not stored (the key's old value is dropped) and goes straight to
``on_evict``, so a tier below may still keep it.

Entries may carry a TTL (``set(..., ttl_s=)``): deadlines are kept on a :class:`.SteadyClock`
(see :mod:`.clock` for what a clock jump does) and an entry is gone from the instant its deadline
is reached. :class:`.TTLCache` is this cache with a default TTL.

Thread-safe: one lock guards the map; ``on_evict`` runs after the lock is released, so a slow
lower tier never stalls readers of this one.
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from .base import CacheBackend, CacheStats, EvictCallback, Key, check_ttl, check_value, key_bytes
from .clock import SteadyClock


@dataclass(frozen=True)
class _Entry:
    value: bytes
    size: int
    deadline: float  # math.inf: no TTL
    seq: int  # tells a live entry from a stale heap record of an older value under the same key


class LRUCache(CacheBackend):
    """LRU by bytes; optional per-entry TTL; ``on_evict(key, value)`` for entries evicted for room."""

    def __init__(self, max_bytes: int, *, on_evict: EvictCallback | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.default_ttl_s: float | None = None
        self._clock = SteadyClock(clock)
        self._data: OrderedDict[bytes, _Entry] = OrderedDict()
        self._deadlines: list[tuple[float, int, bytes]] = []  # min-heap of (deadline, seq, key)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = self._misses = self._sets = self._evictions = self._expirations = 0

    # -- interface -----------------------------------------------------------------------------
    def get(self, key: Key) -> bytes | None:
        k = key_bytes(key)
        with self._lock:
            self._expire(self._clock.now())
            entry = self._data.get(k)
            if entry is None:
                self._misses += 1
                return None
            self._data.move_to_end(k)
            self._hits += 1
            return entry.value

    def set(self, key: Key, value: bytes, ttl_s: float | None = None) -> bool:
        k, v = key_bytes(key), check_value(value)
        ttl = check_ttl(ttl_s) if ttl_s is not None else self.default_ttl_s
        size = len(k) + len(v)
        evicted: list[tuple[bytes, bytes]] = []
        with self._lock:
            now = self._clock.now()
            self._expire(now)
            self._drop(k)
            stored = size <= self.max_bytes
            if stored:
                deadline = now + ttl if ttl is not None else math.inf
                entry = _Entry(v, size, deadline, next(self._seq))
                self._data[k] = entry
                self._bytes += size
                self._sets += 1
                if ttl is not None:
                    heapq.heappush(self._deadlines, (deadline, entry.seq, k))
                while self._bytes > self.max_bytes:
                    old_key, old = self._data.popitem(last=False)
                    self._bytes -= old.size
                    self._evictions += 1
                    evicted.append((old_key, old.value))
            else:
                evicted.append((k, v))
        self._pass_down(evicted)
        return stored

    def invalidate(self, key: Key) -> bool:
        with self._lock:
            return self._drop(key_bytes(key))

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._deadlines.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            self._expire(self._clock.now())
            return CacheStats(hits=self._hits, misses=self._misses, sets=self._sets, bytes=self._bytes,
                              entries=len(self._data), evictions=self._evictions,
                              expirations=self._expirations)

    def keys(self) -> list[bytes]:
        """Live keys, least recently used first (for inspection and tests)."""
        with self._lock:
            self._expire(self._clock.now())
            return list(self._data)

    # -- internals (called with the lock held) ------------------------------------------------
    def _drop(self, k: bytes) -> bool:
        entry = self._data.pop(k, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, seq, k = heapq.heappop(heap)
            entry = self._data.get(k)
            if entry is not None and entry.seq == seq:
                del self._data[k]
                self._bytes -= entry.size
                self._expirations += 1
        if len(heap) > 2 * len(self._data) + 64:  # records of overwritten/invalidated entries
            self._deadlines = [(e.deadline, e.seq, k) for k, e in self._data.items() if e.deadline != math.inf]
            heapq.heapify(self._deadlines)

    def _pass_down(self, evicted: list[tuple[bytes, bytes]]) -> None:
        callback = self.on_evict
        if callback is not None:
            for k, v in evicted:
                callback(k, v)
