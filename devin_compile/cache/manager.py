"""CacheManager: the one object callers hold, over any backend (LRU, TTL, Redis or tiers of them).

``get``/``set`` move bytes; with ``codec=`` they move decoded objects (tensors, KV blocks): the value
is encoded on ``set`` and checked on ``get``. A value the codec rejects (another model fingerprint,
dtype, shape or format version, truncated or corrupted) is counted in ``stats().rejected``, removed
from the backend and answered as a miss, so the caller recomputes it; it is never returned.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Protocol, TypeVar

from .base import CacheBackend, CacheStats, Key
from .tensor_format import RejectedValue

log = logging.getLogger(__name__)
T = TypeVar("T")


class Codec(Protocol[T]):
    """Turns objects into cache values and back; ``decode`` raises :class:`.RejectedValue`
    for a value that is not what this reader expects."""

    def encode(self, obj: T) -> bytes: ...

    def decode(self, data: bytes) -> T: ...


class CacheManager:
    """get / set / invalidate / clear / stats over one :class:`.CacheBackend`; decodes with checks."""

    def __init__(self, backend: CacheBackend) -> None:
        if not isinstance(backend, CacheBackend):
            raise TypeError(f"CacheManager needs a CacheBackend, got {type(backend).__name__}")
        self.backend = backend
        self._lock = threading.Lock()
        self._rejected = 0

    def get(self, key: Key, *, codec: Codec[T] | None = None) -> bytes | T | None:
        """The value under ``key`` (decoded by ``codec`` if given), or ``None``."""
        data = self.backend.get(key)
        if data is None or codec is None:
            return data
        try:
            return codec.decode(data)
        except RejectedValue as exc:
            with self._lock:
                self._rejected += 1
                first = self._rejected == 1
            (log.warning if first else log.debug)(
                "cache value under %r rejected (%s); it is dropped and recomputed%s", key, exc,
                " (further rejections are counted in stats().rejected)" if first else "")
            self.backend.invalidate(key)
            return None

    def set(self, key: Key, value: bytes | T, ttl_s: float | None = None, *, codec: Codec[T] | None = None) -> bool:
        """Store ``value`` (encoded by ``codec`` if given); False if no tier stored it."""
        return self.backend.set(key, codec.encode(value) if codec is not None else value, ttl_s)

    def invalidate(self, key: Key) -> bool:
        return self.backend.invalidate(key)

    def clear(self) -> None:
        self.backend.clear()

    def stats(self) -> CacheStats:
        """The backend's counters, with rejected values moved from hits to misses."""
        s = self.backend.stats()
        with self._lock:
            r = self._rejected
        return replace(s, hits=s.hits - r, misses=s.misses + r, rejected=s.rejected + r)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "CacheManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
