"""The cache interface every backend implements, and the counters it reports.

A cache maps a key (``str`` or ``bytes``) to a value (``bytes``). Values that are tensors are
encoded first (:mod:`.tensor_format`, :class:`.KVBlockCodec`); the backends only store bytes,
so nothing read back from a shared store (Redis) is ever unpickled.

Every method is thread-safe and none raises on a store fault: a backend that cannot reach its
store answers ``get`` with ``None`` and drops the ``set`` (counted in ``errors``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import Callable, Union

Key = Union[str, bytes]
EvictCallback = Callable[[Key, bytes], None]  # (key, value) of an entry evicted for room


def key_bytes(key: Key) -> bytes:
    """A key as bytes (``str`` keys are UTF-8)."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    raise TypeError(f"cache keys are str or bytes, not {type(key).__name__}")


def check_value(value: object) -> bytes:
    """``value`` as immutable bytes; anything else is a caller error."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"cache values are bytes (encode tensors first), not {type(value).__name__}")


def check_ttl(ttl_s: float | None) -> float | None:
    if ttl_s is not None and not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0 seconds or None, got {ttl_s!r}")
    return ttl_s


@dataclass(frozen=True)
class CacheStats:
    """Counters of one cache (or the sum over tiers).

    ``hits``/``misses``: answered ``get`` calls; ``sets``: values stored; ``bytes``/``entries``:
    what the cache holds now; ``evictions``: entries removed to make room; ``expirations``:
    entries dropped at their deadline; ``rejected``: values read back whose header did not match
    (returned as misses); ``errors``: store faults (a ``get`` answered ``None``, a ``set`` dropped).
    """

    hits: int = 0
    misses: int = 0
    sets: int = 0
    bytes: int = 0
    entries: int = 0
    evictions: int = 0
    expirations: int = 0
    rejected: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: "CacheStats") -> "CacheStats":
        return CacheStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


class CacheBackend(ABC):
    """get / set / invalidate / clear / stats over bytes values; thread-safe, never raises on faults."""

    #: set by :class:`.TieredCache` (or the caller) on backends that evict to make room: called
    #: with every entry evicted for room (not for expiry or invalidation), outside the backend's lock.
    on_evict: EvictCallback | None = None

    @abstractmethod
    def get(self, key: Key) -> bytes | None:
        """The value under ``key``, or ``None`` (absent, expired, or the store is unreachable)."""

    @abstractmethod
    def set(self, key: Key, value: bytes, ttl_s: float | None = None) -> bool:
        """Store ``value`` (living at most ``ttl_s`` seconds if given); False if it was not stored."""

    @abstractmethod
    def invalidate(self, key: Key) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry of this cache (counters are kept)."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""

    def close(self) -> None:
        """Release connections; the cache must not be used afterwards."""

    def __enter__(self) -> "CacheBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
