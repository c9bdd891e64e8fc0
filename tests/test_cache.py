"""devin_compile.cache: one interface suite over LRU/TTL/Redis, TTL under clock jumps, concurrency, tiers.

Value format, keys and Redis faults are in test_cache_faults.py. Redis tests run a real redis-server
(tests/redis_server.py); nothing here mocks Redis.
"""
from __future__ import annotations

import random
import struct
import threading

import pytest
import torch
import xxhash
from redis_server import redis_server  # noqa: F401 (fixture)

from devin_compile.cache import (CacheManager, KVBlockCodec, LRUCache, RedisCache, SteadyClock, TieredCache,
                                 TTLCache, kv_block_key, model_fingerprint)

BACKENDS = ["lru", "ttl", "redis"]


@pytest.fixture
def make(request):
    """``make(max_bytes=..., **kw)`` → a fresh cache of the parametrized backend."""
    kind, made = request.param, []

    def build(max_bytes: int = 1 << 24, **kw):
        if kind == "lru":
            cache = LRUCache(max_bytes, **kw)
        elif kind == "ttl":
            cache = TTLCache(max_bytes, kw.pop("ttl_s", 3600.0), **kw)
        else:  # Redis bounds memory on the server: maxmemory + allkeys-lru
            server = request.getfixturevalue("redis_server")
            server.admin().config_set("maxmemory", max_bytes)
            server.admin().config_set("maxmemory-policy", "allkeys-lru")
            cache = RedisCache(server.url, timeout_s=kw.pop("timeout_s", 2.0), **kw)
        made.append(cache)
        return cache

    build.kind = kind
    yield build
    for cache in made:
        cache.close()


def checked_value(key: int, version: int, size: int = 256) -> bytes:
    body = struct.pack("<II", key, version) + random.Random(key * 7919 + version).randbytes(size)
    return body + xxhash.xxh3_64_digest(body)


def check_value(value: bytes, key: int) -> None:
    body, digest = value[:-8], value[-8:]
    assert xxhash.xxh3_64_digest(body) == digest, "torn or corrupted value"
    assert struct.unpack_from("<I", body)[0] == key, "value of another key"


# -- the interface, on every backend -------------------------------------------------------------
@pytest.mark.parametrize("make", BACKENDS, indirect=True)
def test_get_set_invalidate_clear(make):
    c = make()
    assert c.get("a") is None
    assert c.set("a", b"1") and c.set(b"b", b"22")
    assert c.get(b"a") == b"1" and c.get("b") == b"22"  # str keys are their UTF-8 bytes
    assert c.set("a", b"333") and c.get("a") == b"333"
    assert c.invalidate("a") and not c.invalidate("a") and c.get("a") is None
    c.clear()
    assert c.get("b") is None
    s = c.stats()
    assert (s.hits, s.misses, s.sets, s.errors) == (3, 3, 3, 0)
    with pytest.raises(TypeError):
        c.set("x", "not bytes")
    with pytest.raises(ValueError):
        c.set("x", b"v", ttl_s=0)


@pytest.mark.parametrize("make", BACKENDS, indirect=True)
def test_byte_bound(make):
    limit, size = 4 << 20, 64 << 10
    c = make(max_bytes=limit)
    for i in range(3 * limit // size):
        c.set(f"k{i}", bytes([i % 251]) * size)
        assert c.stats().bytes <= limit + 2 * size  # Redis evicts before the next write
    s = c.stats()
    assert s.evictions > 0 and s.bytes <= limit + 2 * size
    assert c.get(f"k{i}") == bytes([i % 251]) * size and c.get("k0") is None


# LRU order is exact only in process: Redis's allkeys-lru samples keys on a 1-second clock.
@pytest.mark.parametrize("make", ["lru", "ttl"], indirect=True)
def test_lru_order_and_eviction_callback(make):
    evicted = []
    c = make(max_bytes=3 * 11, on_evict=lambda k, v: evicted.append(k))  # key 1 byte + value 10
    for k in "abc":
        c.set(k, b"x" * 10)
    c.get("a")  # a is now the most recent: b goes first
    c.set("d", b"x" * 10)
    c.set("b", b"y" * 10)
    assert evicted == [b"b", b"c"] and c.keys() == [b"a", b"d", b"b"]
    assert not c.set("big", b"z" * 40) and evicted[-1] == b"big"  # too large for the tier: passed down
    assert c.stats().evictions == 2


# -- TTL with an injected clock ------------------------------------------------------------------
class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_ttl_expires_exactly_at_deadline_and_on_forward_jump():
    clock = FakeClock(100.0)
    c = TTLCache(1 << 20, 10.0, clock=clock)
    c.set("a", b"1")
    c.set("b", b"2", ttl_s=30)  # the call's ttl_s wins
    clock.t = 109.999
    assert c.get("a") == b"1"
    clock.t = 110.0
    assert c.get("a") is None and c.get("b") == b"2"
    clock.t = 500.0  # forward jump past b's deadline
    assert c.get("b") is None
    assert c.stats().expirations == 2 and c.stats().bytes == 0


def test_ttl_backward_jump_counts_as_no_time():
    clock = FakeClock(100.0)
    c = TTLCache(1 << 20, 10.0, clock=clock)
    c.set("a", b"1")  # deadline 110
    c.set("gone", b"x", ttl_s=1)  # deadline 101
    clock.t = 105.0
    assert c.get("gone") is None
    clock.t = 50.0  # back 55 s: steady time stays at 105, so a keeps its 5 s left and gone stays gone
    assert c.get("a") == b"1" and c.get("gone") is None
    clock.t = 54.999
    assert c.get("a") == b"1"
    clock.t = 55.0  # 5 s of clock progress after the jump: exactly a's deadline
    assert c.get("a") is None
    c.set("c", b"3")  # set after the jump: lives 10 s of clock progress from now
    clock.t = 64.999
    assert c.get("c") == b"3"
    clock.t = 65.0
    assert c.get("c") is None


def test_steady_clock_and_lru_per_entry_ttl():
    clock = FakeClock(10.0)
    steady = SteadyClock(clock)
    seen = []
    for t in (10.0, 12.0, 3.0, 4.0, 20.0):
        clock.t = t
        seen.append(steady.now())
    assert seen == [10.0, 12.0, 12.0, 13.0, 29.0]
    c = LRUCache(1 << 20, clock=clock)
    c.set("t", b"1", ttl_s=2)
    c.set("forever", b"2")
    clock.t = 1e9
    assert c.get("t") is None and c.get("forever") == b"2"
    with pytest.raises(ValueError):
        TTLCache(1 << 20, None)


# -- concurrency ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make", BACKENDS, indirect=True)
def test_concurrent_mixed_traffic(make):
    n_keys, n_threads, ops = 200, 100, 100
    c = make(max_bytes=64 << 20, **({"max_connections": n_threads} if make.kind == "redis" else {}))
    for k in range(n_keys):
        assert c.set(f"k{k}", checked_value(k, 0))
    hits, misses, errors = [0] * n_threads, [0] * n_threads, []
    barrier = threading.Barrier(n_threads)

    def worker(i: int) -> None:
        rng = random.Random(i)
        try:
            barrier.wait()
            for j in range(ops):
                k = rng.randrange(n_keys)
                if rng.random() < 0.2:
                    c.set(f"k{k}", checked_value(k, i * ops + j + 1))
                    continue
                value = c.get(f"k{k}")
                if value is None:
                    misses[i] += 1
                else:
                    hits[i] += 1
                    check_value(value, k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    s = c.stats()
    assert s.evictions == 0 and s.errors == 0  # every key was set and none evicted
    assert sum(hits) / (sum(hits) + sum(misses)) >= 0.992


# -- tiers ---------------------------------------------------------------------------------------
def test_tiers_write_down_on_eviction_and_promote_on_hit():
    host, lower = LRUCache(3 * 12), LRUCache(1 << 20)  # host holds 3 entries of key 2 + value 10
    tiers = TieredCache([host, lower])
    for i in range(6):
        tiers.set(f"k{i}", bytes([i]) * 10)
    assert host.keys() == [b"k3", b"k4", b"k5"] and lower.keys() == [b"k0", b"k1", b"k2"]
    assert tiers.get("k0") == bytes([0]) * 10  # from the lower tier, promoted up (k3 goes down)
    assert host.keys() == [b"k4", b"k5", b"k0"] and b"k3" in lower.keys()
    assert tiers.get("k0") == bytes([0]) * 10 and tiers.hits_by_tier() == [1, 1]
    assert tiers.get("nope") is None
    assert tiers.invalidate("k0") and host.get("k0") is None and lower.get("k0") is None
    s = tiers.stats()
    assert (s.hits, s.misses, s.sets, s.entries) == (2, 1, 6, 5)  # k4 k5 | k1 k2 k3
    with pytest.raises(ValueError):
        TieredCache([host, LRUCache(10)])  # host already passes evictions down


def test_tiers_through_redis_share_kv_blocks_across_replicas(redis_server):  # noqa: F811
    torch.manual_seed(0)
    fp = model_fingerprint(weights_digest="w", dtype=torch.float16, quantization=None, kv_layout="x", block_size=4)
    codec = KVBlockCodec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16, fingerprint=fp)
    pool = torch.randn(3, 2, 10, 4, 2, 8).half()  # [layer, k/v, block, token, head, dim]
    value_size = len(codec.encode(pool[:, :, 0]))
    replica = [CacheManager(TieredCache([LRUCache(2 * (value_size + 100)), RedisCache(redis_server.url, ttl_s=60)]))
               for _ in range(2)]
    for b in range(10):
        replica[0].set(kv_block_key(1000 + b, fp), pool[:, :, b], codec=codec)
    # blocks 0..7 were evicted from replica 0's host tier into Redis; replica 1 loads them from there
    for b in range(8):
        assert torch.equal(replica[1].get(kv_block_key(1000 + b, fp), codec=codec), pool[:, :, b])
    assert replica[1].get(kv_block_key(1008, fp), codec=codec) is None  # still only in replica 0's host tier
    assert replica[1].backend.hits_by_tier() == [0, 8] and replica[1].stats().rejected == 0
    for r in replica:
        r.close()
