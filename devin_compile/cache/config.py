"""The KV cache tiers a user asks for: ``optimize(model, kv_cache_tiers=[...])``.

    kv_cache_tiers=[{"backend": "host_lru", "max_bytes": 2 << 30},
                    {"backend": "redis", "url": "redis://127.0.0.1:6379/0", "ttl_s": 3600}]

Tiers are listed fastest first. A tier with ``write_through`` (default: True for Redis, False for
host tiers) gets every prefix block as soon as the pool registers it (a background thread stores
it), so other replicas can load a prefix while this process still holds it. A block the paged pool
evicts goes to the first tier without ``write_through``; a host tier that evicts passes the block
to the next one (unless that one is written through: it has the block already). Backends:

- ``host_lru``: :class:`.LRUCache` in this process, bounded by ``max_bytes``;
- ``host_ttl``: :class:`.TTLCache`, bounded by ``max_bytes``, entries live ``ttl_s`` seconds;
- ``redis``: :class:`.RedisCache` at ``url`` (entries expire after ``ttl_s`` when given; the
  server's ``maxmemory`` bounds it), shared by every process using the same server. It must be
  the last tier (Redis evicts on the server and cannot pass blocks down). ``write_through=False``:
  it gets only what the pool (or the host tier above it) evicts.

:func:`coerce` validates the list (``ValueError`` naming the bad key and the valid ones);
:func:`build_backends` makes the backends.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from .base import CacheBackend
from .lru import LRUCache
from .redis_cache import RedisCache
from .ttl import TTLCache


def _flag(what: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{what}={value!r} must be True or False")


def _positive(what: str, value: Any, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise ValueError(f"{what}={value!r} must be a positive {'integer' if integer else 'number'}")


@dataclass(frozen=True)
class HostLRUTier:
    """Host memory, least recently used block evicted first (to the next tier)."""

    max_bytes: int
    write_through: bool = False
    backend: str = "host_lru"

    def __post_init__(self) -> None:
        _positive("kv_cache_tiers[host_lru].max_bytes", self.max_bytes, integer=True)
        _flag("kv_cache_tiers[host_lru].write_through", self.write_through)

    def build(self) -> CacheBackend:
        return LRUCache(self.max_bytes)


@dataclass(frozen=True)
class HostTTLTier:
    """Host memory; a block lives ``ttl_s`` seconds from when it was stored, LRU under byte pressure."""

    max_bytes: int
    ttl_s: float
    write_through: bool = False
    backend: str = "host_ttl"

    def __post_init__(self) -> None:
        _positive("kv_cache_tiers[host_ttl].max_bytes", self.max_bytes, integer=True)
        _positive("kv_cache_tiers[host_ttl].ttl_s", self.ttl_s)
        _flag("kv_cache_tiers[host_ttl].write_through", self.write_through)

    def build(self) -> CacheBackend:
        return TTLCache(self.max_bytes, self.ttl_s)


@dataclass(frozen=True)
class RedisTier:
    """A Redis server shared by replicas; faults (down, slow, restarted) become misses, never errors."""

    url: str
    ttl_s: float | None = None
    timeout_s: float = 0.25
    key_prefix: str = "devin:"
    write_through: bool = True
    backend: str = "redis"

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_cache_tiers[redis].url={self.url!r} must be a redis://, rediss:// or unix:// URL")
        if self.ttl_s is not None:
            _positive("kv_cache_tiers[redis].ttl_s", self.ttl_s)
        _positive("kv_cache_tiers[redis].timeout_s", self.timeout_s)
        if not isinstance(self.key_prefix, str) or not self.key_prefix:
            raise ValueError(f"kv_cache_tiers[redis].key_prefix={self.key_prefix!r} must be a non-empty string")
        _flag("kv_cache_tiers[redis].write_through", self.write_through)

    def build(self) -> CacheBackend:
        return RedisCache(self.url, self.ttl_s, timeout_s=self.timeout_s, key_prefix=self.key_prefix)


TierConfig = Union[HostLRUTier, HostTTLTier, RedisTier]
BACKENDS: dict[str, type] = {"host_lru": HostLRUTier, "host_ttl": HostTTLTier, "redis": RedisTier}


def _tier(value: Any, index: int) -> TierConfig:
    if isinstance(value, tuple(BACKENDS.values())):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"kv_cache_tiers[{index}]={value!r} must be a dict like "
                         "{'backend': 'host_lru', 'max_bytes': 2 << 30}")
    kind = value.get("backend")
    if kind not in BACKENDS:
        raise ValueError(f"kv_cache_tiers[{index}].backend={kind!r} is unknown; valid backends: {sorted(BACKENDS)}")
    cls = BACKENDS[kind]
    fields = dataclasses.fields(cls)
    valid = [f.name for f in fields]
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"kv_cache_tiers[{index}] ({kind}) got unknown keys {unknown}; valid keys: {valid}")
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"kv_cache_tiers[{index}] ({kind}) needs {missing}; valid keys: {valid}")
    return cls(**value)


def coerce(value: Any) -> tuple[TierConfig, ...] | None:
    """None / [] → None (no tiers); a list of tier dicts (or tier configs) → validated tier configs."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(f"kv_cache_tiers={value!r} must be a list of tier dicts, fastest first, e.g. "
                         "[{'backend': 'host_lru', 'max_bytes': 2 << 30}, "
                         "{'backend': 'redis', 'url': 'redis://127.0.0.1:6379/0'}]")
    tiers = tuple(_tier(v, i) for i, v in enumerate(value))
    for i, t in enumerate(tiers[:-1]):
        if isinstance(t, RedisTier):
            raise ValueError(f"kv_cache_tiers[{i}] is redis but not the last tier: Redis evicts on the server and "
                             "cannot pass blocks down, so it must come last")
    return tiers or None


def build_backends(tiers: Sequence[TierConfig]) -> list[CacheBackend]:
    """One fresh backend per tier, in order."""
    return [t.build() for t in tiers]
