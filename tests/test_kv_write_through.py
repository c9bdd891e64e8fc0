"""Write-through of registered prefix blocks (runtime/kv_write_through.py, KVTiers.register): a block
reaches the write-through tiers (Redis) when the pool registers it, not only when it is evicted, so a
second replica finds a prefix the first one has computed and still holds.

The publisher's unit tests run on a small real pool with in-memory targets (one whose ``set`` waits
on a gate, to hold the queue full); engine tests run the seeded tiny Llama of test_kv_tiers.py on a
real redis-server (tests/redis_server.py); nothing mocks Redis.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from redis_server import free_port, redis_server  # noqa: F401 (fixture)
from test_kv_tiers import A, BS, C, POOL, PRE, greedy, hf, make_engine, run_one, tiny_llama, toks

import devin_compile as dc
from devin_compile.cache import KVBlockCodec, LRUCache, RedisCache
from devin_compile.cache.config import coerce
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
from devin_compile.runtime.kv_tiers import KVTiers
from devin_compile.runtime.kv_write_through import WriteThrough
from devin_compile.runtime.prefix_cache import CachedBlock, chain_hashes
from devin_compile.serve.metrics import ServerMetrics

HERE = os.path.dirname(os.path.abspath(__file__))


class GatedLRU(LRUCache):
    """An in-memory target whose ``set`` waits until ``gate`` is set (the queue stays full meanwhile)."""

    def __init__(self) -> None:
        super().__init__(1 << 24)
        self.gate = threading.Event()
        self.calls: list[str] = []
        self.nice: list[int] = []  # the storing thread's nice value at each set

    def set(self, key, value, ttl_s=None) -> bool:
        assert self.gate.wait(30), "gate never opened"
        self.calls.append(key)
        if sys.platform == "linux":
            self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().set(key, value, ttl_s)


class Broken(LRUCache):
    """A target with a bug: ``set`` raises on the first call, then works."""

    def __init__(self) -> None:
        super().__init__(1 << 24)
        self.raised = False

    def set(self, key, value, ttl_s=None) -> bool:
        if not self.raised:
            self.raised = True
            raise RuntimeError("boom")
        return super().set(key, value, ttl_s)


def small_pool(num_blocks: int = 8) -> PagedKVCache:
    pool = PagedKVCache(KVCacheSpec(2, 1, 4, torch.float32, 2), num_blocks)
    pool.data.copy_(torch.randn(pool.data.shape))
    return pool


def entries(blocks: list[int]) -> list[CachedBlock]:
    return [CachedBlock(block=b, hash=1000 + b, parent=0, tokens=(b, b), id=b + 1) for b in blocks]


def writer(targets, pool: PagedKVCache, blocks_capacity: int | None = None) -> WriteThrough:
    codec = KVBlockCodec.from_spec(pool.spec, "fp")
    kw = {"max_bytes": blocks_capacity * codec.nbytes} if blocks_capacity else {}
    return WriteThrough(targets, pool, codec, lambda h: f"k{h}", **kw)


# ----------------------------------------------------------------------------------------
# The publisher alone


def test_block_is_copied_at_submit_and_published_once():
    pool, target = small_pool(), LRUCache(1 << 24)
    w = writer([target], pool)
    want = {b: pool.data[:, :, b].clone() for b in (1, 4)}
    w.submit(entries([1, 4]))
    pool.data[:, :, [1, 4]] = 0  # the pool reuses the blocks at once: the queued copies are unaffected
    w.submit(entries([1, 4]))  # registered again (another sequence, an eviction): not queued twice
    assert w.flush(30)
    for b in (1, 4):
        torch.testing.assert_close(w.codec.decode(target.get(f"k{1000 + b}")), want[b], rtol=0, atol=0)
    assert (w.published, w.dropped, w.failed, w.queue_depth) == (2, 0, 0, 0) and target.stats().sets == 2
    w.remember("k1002")  # a block loaded from a tier: never queued
    w.submit(entries([2]))
    assert w.flush(30) and w.published == 2 and target.get("k1002") is None
    w.close()
    assert w._thread is None


def test_full_queue_drops_instead_of_waiting_and_the_block_can_come_again():
    pool, target = small_pool(), GatedLRU()
    w = writer([target], pool, blocks_capacity=2)
    w.submit(entries([0, 1, 2, 3, 4]))  # returns at once although nothing can be stored yet
    s = w.stats()
    assert (s["kv_tier_write_through_dropped"], s["kv_tier_write_through_queue_depth"]) == (3, 2)
    assert s["kv_tier_write_through_queue_bytes"] == 2 * w.codec.nbytes
    assert not w.flush(0.05)  # the gate holds the queue
    target.gate.set()
    assert w.flush(30) and w.published == 2 and sorted(target.calls) == ["k1000", "k1001"]
    w.submit(entries([2, 3, 4]))  # dropped blocks were forgotten: offered again (e.g. on eviction)
    assert w.flush(30) and w.published == 4 and w.dropped == 4  # one more dropped: capacity 2
    w.close()


def test_store_faults_are_counted_never_raised(caplog):
    pool, broken = small_pool(), Broken()
    dead = RedisCache(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1)  # nothing listens there
    w = writer([dead], pool)
    w.submit(entries([0, 1]))
    assert w.flush(30)
    assert (w.published, w.failed) == (0, 2) and dead.stats().errors >= 1
    assert not w.known("k1000")  # a failed store forgets the key: the block may be offered again
    w2 = writer([broken], pool)
    w2.submit(entries([0, 1]))  # the first set raises: logged and counted, the thread goes on
    assert w2.flush(30) and (w2.published, w2.failed) == (1, 1) and broken.get("k1001") is not None
    assert "KV write-through of k1000 failed" in caplog.text
    w2.pool = PagedKVCache(KVCacheSpec(3, 1, 4, torch.float32, 2), 8)  # copying out of it fails: another shape
    w2.submit(entries([5]))
    assert (w2.failed, w2.queue_depth) == (2, 0) and not w2.known("k1005") and "could not copy" in caplog.text
    w.close()
    w2.close()


def test_close_drains_or_discards_and_a_later_submit_restarts():
    pool, target = small_pool(), GatedLRU()
    w = writer([target], pool)
    w.submit(entries([0, 1, 2]))
    threading.Timer(0.2, target.gate.set).start()
    w.close()  # drains: waits for the gate, stores all three
    assert w.published == 3 and w._thread is None
    target.gate.clear()
    w.submit(entries([3, 4, 5]))  # a new thread
    assert w._thread is not None and w._thread.daemon
    threading.Timer(0.2, target.gate.set).start()
    w.close(drain=False)  # the block being stored finishes; the queued rest is discarded
    assert w.published + w.discarded == 6 and w.discarded >= 1 and w.queue_depth == 0
    if sys.platform == "linux":  # the thread stored below the process's priority
        assert set(target.nice) == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)}
    assert not w.known(f"k{1000 + 5}")  # discarded: not stored, so not remembered


def test_bad_writer_options():
    pool = small_pool()
    with pytest.raises(ValueError, match="at least one target"):
        writer([], pool)
    with pytest.raises(ValueError, match="max_bytes=0 must be a positive integer"):
        WriteThrough([LRUCache(1 << 20)], pool, KVBlockCodec.from_spec(pool.spec, "fp"), str, max_bytes=0)


def test_tiers_route_registration_and_eviction():
    """Write-through tiers get registered blocks; evictions go to the first other tier (not passed down
    into a write-through one), and re-offer the blocks the write-through dropped."""
    pool = small_pool()
    codec = KVBlockCodec.from_spec(pool.spec, "fp")
    tiers = KVTiers(coerce([{"backend": "host_lru", "max_bytes": 1 << 20},
                            {"backend": "host_ttl", "max_bytes": 1 << 24, "ttl_s": 600, "write_through": True}]),
                    pool, "fp", write_queue_bytes=codec.nbytes)
    host, through = tiers.tiers
    assert host.on_evict is None and tiers.evict_into is host
    e = entries([0, 1, 2])
    tiers.register(e)  # capacity 1: one queued, two dropped
    assert tiers.flush(30) and through.stats().entries == 1 and host.stats().entries == 0
    tiers.publish(e)  # the pool evicts them: all go to the host tier, the write-through gets one more
    assert tiers.flush(30) and through.stats().entries == 2 and host.stats().entries == 3
    s = tiers.stats()
    assert s["kv_tier_write_through_published"] == 2 and s["kv_tier_write_through_dropped"] == 3
    assert s["kv_tier_published_blocks"] == 3 + 2 and [t["write_through"] for t in s["kv_tiers"]] == [False, True]
    tiers.close()


# ----------------------------------------------------------------------------------------
# Engines on a real Redis


@pytest.fixture(scope="module")
def opt():
    return dc.optimize(tiny_llama(), num_kv_blocks=POOL, block_size=BS)


def test_registered_block_reaches_redis_without_eviction(opt, redis_server):  # noqa: F811
    engine = make_engine(opt, [{"backend": "host_lru", "max_bytes": 1 << 20},
                               {"backend": "redis", "url": redis_server.url}])
    seq = run_one(engine, A)  # A: 35 prompt tokens + 3 computed outputs = 9 full blocks
    stats = engine.kv_stats()
    assert stats["prefix_evictions"] == 0 and stats["kv_tier_write_through_published"] == 9
    assert stats["kv_tiers"][0]["entries"] == 0  # the host tier gets evictions only
    admin = redis_server.admin()
    for h in chain_hashes(A + seq.output_ids[:1], BS):
        value = admin.get(b"devin:" + engine.kv.tiers.key(h).encode())
        block = engine.kv.prefix_cache.get(h).block
        torch.testing.assert_close(engine.kv.tiers.codec.decode(value), engine.runner.kv_cache.data[:, :, block])
    text = ServerMetrics(engine, lambda: 0).render().decode()
    assert "devin_kv_tier_write_through_published_total 9.0" in text
    assert "devin_kv_tier_write_through_dropped_total 0.0" in text and "devin_kv_tier_write_through_queue_blocks 0.0" in text
    engine.close()


def test_serve_cli_redis_write_through_flag():
    from devin_compile.cli import serve as serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    url = ["--kv-cache-redis", "redis://127.0.0.1:6379/0"]
    on = serve_cli.optimize_options(p.parse_args(url))["kv_cache_tiers"]
    off = serve_cli.optimize_options(p.parse_args(url + ["--no-kv-cache-redis-write-through"]))["kv_cache_tiers"]
    assert [t.write_through for t in coerce(on)] == [True] and [t.write_through for t in coerce(off)] == [False]


def test_two_engines_one_redis_the_second_loads_what_the_first_still_holds(opt, redis_server):  # noqa: F811
    tiers = [{"backend": "redis", "url": redis_server.url}]
    first, second = make_engine(opt, tiers), make_engine(opt, tiers)
    out_first = run_one(first, PRE + toks(3, 11), 6).output_ids
    assert first.kv_stats()["blocks_cached"] >= 8  # it still holds the preamble
    seq = run_one(second, C, 6)
    assert seq.metrics.tier_hit_tokens == 32 and seq.output_ids == hf(C, 6)
    assert out_first == hf(PRE + toks(3, 11), 6)
    s = second.kv_stats()
    # the 8 loaded blocks are registered but not written back; only those it computed are
    assert s["kv_tier_hits"] == 8 and s["kv_tier_write_through_published"] == (len(C) + 5) // BS - 8
    first.close()
    second.close()


def test_redis_down_write_through_fails_quietly(opt):
    engine = make_engine(opt, [{"backend": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "timeout_s": 0.1}])
    rids = [engine.add_request(p, greedy(4)) for p in (A, C)]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.tiers.flush(30)
    assert [engine.requests[r].output_ids for r in rids] == [hf(A), hf(C)]
    s = engine.kv_stats()
    assert s["kv_tier_write_through_failed"] > 0 and s["kv_tier_write_through_published"] == 0
    assert s["kv_tiers"][0]["errors"] > 0
    engine.close()


SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import devin_compile as dc
from test_kv_tiers import A, BS, POOL, run_one, tiny_llama
opt = dc.optimize(tiny_llama(), num_kv_blocks=POOL, block_size=BS, kv_cache_tiers=[{{"backend": "redis", "url": sys.argv[1]}}])
seq = run_one(opt.engine, A)
stats = opt.engine.kv_stats()
print(json.dumps({{"output": seq.output_ids, "tier_hit_tokens": seq.metrics.tier_hit_tokens,
                  "hits": stats["kv_tier_hits"], "redis_hits": stats["kv_tiers"][0]["hits"]}}))
"""


def test_second_process_reuses_blocks_the_first_one_still_holds(redis_server, tmp_path):  # noqa: F811
    first = dc.optimize(tiny_llama(), num_kv_blocks=POOL, block_size=BS,
                        kv_cache_tiers=[{"backend": "redis", "url": redis_server.url}])
    out_a = run_one(first.engine, A).output_ids
    stats = first.engine.kv_stats()  # nothing was evicted: the blocks reached Redis when registered
    assert stats["prefix_evictions"] == 0 and stats["blocks_cached"] == 9
    assert stats["kv_tier_write_through_published"] == 9 == stats["kv_tier_published_blocks"]
    script = tmp_path / "second.py"
    script.write_text(SCRIPT.format(tests=HERE))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    proc = subprocess.run([sys.executable, str(script), redis_server.url], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["tier_hit_tokens"] == 32 and second["hits"] == second["redis_hits"] == 8
    assert second["output"] == out_a == hf(A)
    first.engine.close()
