"""A cache on a Redis server (through redis-py), shared by every process that uses the same keys.

- **Connections**: one bounded, blocking connection pool per cache (``max_connections``; a caller
  waits at most ``timeout_s`` for a free connection). Thread-safe.
- **Values** are binary (``bytes`` in, ``bytes`` out; nothing is unpickled). Keys are
  ``key_prefix + key``; :meth:`clear` deletes only keys under the prefix.
- **Expiry** is the server's: ``SET key value PX <ms>`` with the call's ``ttl_s`` or the cache's
  default ``ttl_s`` (``None``: no expiry; the server's ``maxmemory`` policy bounds memory).
- **Faults** never reach the caller. Every call has a socket timeout (``timeout_s``, for connect
  and for each reply) and no retries. When Redis is down, slow or restarting, ``get`` answers
  ``None`` and ``set`` is dropped (``False``); each such call counts in ``stats().errors``, and one
  warning is logged per outage (an info line when Redis answers again). After a fault, calls skip
  Redis for ``backoff_s`` seconds, so an unreachable server costs at most one time-out per
  ``backoff_s`` instead of one per call.
- **Stats**: ``hits``, ``misses``, ``sets``, ``errors`` count this client's calls; ``bytes``,
  ``entries`` and ``evictions`` are the server's (``used_memory``, ``DBSIZE``, ``evicted_keys``),
  since the server owns the memory (the last known values while it is unreachable).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, TypeVar

from .base import CacheBackend, CacheStats, Key, check_ttl, check_value, key_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")
_GLOB_SPECIAL = b"*?[]\\"


class RedisCache(CacheBackend):
    """get / set / invalidate / clear / stats on a Redis server; faults become misses and dropped sets."""

    def __init__(self, url: str, ttl_s: float | None = None, *, timeout_s: float = 0.25,
                 key_prefix: str | bytes = "devin:", max_connections: int = 32, backoff_s: float = 1.0) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - redis is a declared dependency
            raise ImportError("RedisCache needs redis-py: pip install 'redis>=5'") from exc
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.prefix = key_bytes(key_prefix)
        if not self.prefix:
            raise ValueError("key_prefix must not be empty (clear() deletes the keys under it)")
        self.default_ttl_s = check_ttl(ttl_s)
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._faults: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self._client = redis.Redis(connection_pool=self._pool)
        kw = self._pool.connection_kwargs
        self.where = f"redis {kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}/{kw.get('db', 0)}"
        self._lock = threading.Lock()
        self._down = False
        self._skip_until = 0.0
        self._hits = self._misses = self._sets = self._errors = 0
        self._server = {"bytes": 0, "entries": 0, "evictions": 0}

    # -- interface -----------------------------------------------------------------------------
    def get(self, key: Key) -> bytes | None:
        k = self.prefix + key_bytes(key)
        value = self._call("GET", lambda: self._client.get(k), None)
        with self._lock:
            if value is None:
                self._misses += 1
            else:
                self._hits += 1
        return value

    def set(self, key: Key, value: bytes, ttl_s: float | None = None) -> bool:
        k, v = self.prefix + key_bytes(key), check_value(value)
        ttl = check_ttl(ttl_s) if ttl_s is not None else self.default_ttl_s
        px = max(1, math.ceil(ttl * 1000)) if ttl is not None else None
        stored = bool(self._call("SET", lambda: self._client.set(k, v, px=px), False))
        if stored:
            with self._lock:
                self._sets += 1
        return stored

    def invalidate(self, key: Key) -> bool:
        k = self.prefix + key_bytes(key)
        return bool(self._call("UNLINK", lambda: self._client.unlink(k), 0))

    def clear(self) -> None:
        pattern = b"".join(b"\\" + bytes([c]) if c in _GLOB_SPECIAL else bytes([c]) for c in self.prefix) + b"*"

        def delete_all() -> None:
            batch: list[bytes] = []
            for k in self._client.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 500:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

        self._call("SCAN/UNLINK", delete_all, None)

    def stats(self) -> CacheStats:
        def server() -> dict[str, int]:
            pipe = self._client.pipeline(transaction=False)
            pipe.info("memory").info("stats").dbsize()
            memory, stats, size = pipe.execute()
            return {"bytes": int(memory["used_memory"]), "entries": int(size),
                    "evictions": int(stats["evicted_keys"])}

        fresh = self._call("INFO", server, None, count_error=False)
        with self._lock:
            if fresh is not None:
                self._server = fresh
            return CacheStats(hits=self._hits, misses=self._misses, sets=self._sets,
                              errors=self._errors, **self._server)

    def close(self) -> None:
        self._pool.disconnect()

    # -- faults --------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T], default: T, *, count_error: bool = True) -> T:
        """``fn()``, or ``default`` when Redis fails (or failed less than ``backoff_s`` ago)."""
        if self._down and time.monotonic() < self._skip_until:
            if count_error:
                with self._lock:
                    self._errors += 1
            return default
        try:
            result = fn()
        except self._faults as exc:
            self._fault(what, exc, count_error)
            return default
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    log.info("%s answers again; the KV cache tier is back", self.where)
        return result

    def _fault(self, what: str, exc: BaseException, count_error: bool) -> None:
        with self._lock:
            if count_error:
                self._errors += 1
            self._skip_until = time.monotonic() + self.backoff_s
            if not self._down:
                self._down = True
                log.warning("%s failed on %s (%s: %s): gets miss and sets are dropped until it answers "
                            "again (retrying every %.3g s)", self.where, what, type(exc).__name__, exc,
                            self.backoff_s)
