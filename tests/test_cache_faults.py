"""devin_compile.cache: what must be rejected (the tensor value format, keys that cannot collide, values
tampered in Redis) and Redis faults (server-side expiry, a killed, restarted or slow server).

Redis tests run a real redis-server (tests/redis_server.py); nothing here mocks Redis.
"""
from __future__ import annotations

import logging
import time

import pytest
import torch
from redis_server import redis_server  # noqa: F401 (fixture)

from devin_compile.cache import (CacheManager, KVBlockCodec, RedisCache, RejectedValue, decode_tensor,
                                 encode_tensor, kv_block_key, model_fingerprint, state_dict_digest)


# -- value format and keys -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool,
                                   torch.float8_e4m3fn])
def test_tensor_format_round_trip(dtype):
    t = (torch.randn(2, 3, 5) * 4).to(dtype)
    for x in (t, t.transpose(0, 2), t[0, 0, 0], t[:0]):
        y = decode_tensor(encode_tensor(x, "fp"), dtype=dtype, shape=tuple(x.shape), fingerprint="fp")
        assert y.dtype == dtype and y.shape == x.shape
        assert torch.equal(y.reshape(-1).view(torch.uint8), x.contiguous().reshape(-1).view(torch.uint8))


def test_tensor_format_rejects_what_the_reader_does_not_expect():
    data = encode_tensor(torch.arange(12, dtype=torch.float32).reshape(3, 4), "fp")
    expect = dict(dtype=torch.float32, shape=(3, 4), fingerprint="fp")
    decode_tensor(data, **expect)
    wrong = [data[:n] for n in (0, 10, 30, len(data) - 1)]  # truncated anywhere
    wrong += [data + b"\0", b"XXXX" + data[4:], data[:4] + b"\x02\x00" + data[6:],  # longer, magic, version
              data[:-1] + bytes([data[-1] ^ 1])]  # one flipped payload bit
    wrong += [encode_tensor(torch.zeros(4, 3), "fp"), encode_tensor(torch.zeros(3, 4).half(), "fp"),
              encode_tensor(torch.zeros(3, 4), "other")]
    for bad in wrong:
        with pytest.raises(RejectedValue):
            decode_tensor(bad, **expect)


def test_keys_and_fingerprints_cannot_collide():
    facts = dict(weights_digest="abc", dtype=torch.float16, quantization=None, kv_layout="L30", block_size=16)
    fp = model_fingerprint(**facts)
    assert fp == model_fingerprint(**facts) and len(fp) == 32
    changed = [model_fingerprint(**{**facts, name: value}) for name, value in
               [("weights_digest", "abd"), ("dtype", torch.bfloat16), ("quantization", "int4-g64"),
                ("kv_layout", "L31"), ("block_size", 32)]] + [model_fingerprint(**facts, rope="x")]
    assert len({fp, *changed}) == 7
    h = (1 << 127) + 12345
    assert kv_block_key(h, fp) == kv_block_key(h.to_bytes(16, "little"), fp) == kv_block_key(f"{h:x}", fp)
    assert kv_block_key(h, fp).startswith("kv:v1:") and kv_block_key(h, fp) != kv_block_key(h, changed[0])
    with pytest.raises(ValueError):
        kv_block_key(-1, fp)
    w = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    assert state_dict_digest(w) == state_dict_digest(dict(reversed(w.items())))
    assert state_dict_digest(w) != state_dict_digest({**w, "a": torch.tensor([1.0, 1.0, 2.0])})


# -- Redis: server-side expiry, namespaces, tampered values, faults -------------------------------
def test_redis_expiry_is_server_side_and_clear_keeps_other_prefixes(redis_server):  # noqa: F811
    admin = redis_server.admin()
    with RedisCache(redis_server.url, ttl_s=60, key_prefix="a:") as a, RedisCache(redis_server.url, key_prefix="b:") as b:
        a.set("x", b"1")
        a.set("y", b"2", ttl_s=0.5)
        b.set("x", b"3")
        assert 59_000 < admin.pttl("a:x") <= 60_000 and 0 < admin.pttl("a:y") <= 500 and admin.pttl("b:x") == -1
        a.clear()
        assert a.get("x") is None and b.get("x") == b"3" and admin.exists("a:x", "a:y") == 0


def test_redis_tampered_values_are_rejected(redis_server):  # noqa: F811
    admin = redis_server.admin()
    fp = model_fingerprint(weights_digest="w", dtype=torch.float16, quantization=None, kv_layout="x", block_size=4)
    codec = KVBlockCodec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16, fingerprint=fp)
    block = torch.randn(codec.shape).half()
    cm = CacheManager(RedisCache(redis_server.url, key_prefix="t:"))
    key = kv_block_key(42, fp)
    good = codec.encode(block)
    tampered = [good[:-10], good[:20],
                encode_tensor(torch.randn(2, 2, 8, 2, 4).half(), fp),  # another shape, same bytes
                encode_tensor(block, "another-model"), encode_tensor(block.float(), fp)]
    for n, bad in enumerate(tampered, start=1):
        admin.set("t:" + key, bad)
        assert cm.get(key, codec=codec) is None
        assert cm.stats().rejected == n and admin.exists("t:" + key) == 0  # dropped, to be recomputed
    assert cm.set(key, block, codec=codec) and torch.equal(cm.get(key, codec=codec), block)
    s = cm.stats()
    assert (s.hits, s.misses, s.rejected, s.errors) == (1, 5, 5, 0)
    cm.close()


def test_redis_killed_mid_run_misses_and_drops_then_recovers(redis_server, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="devin_compile.cache.redis_cache")
    c = RedisCache(redis_server.url, timeout_s=0.2, backoff_s=0.0)
    assert c.set("k", b"v") and c.get("k") == b"v"
    redis_server.kill()
    for _ in range(5):  # every call fails fast and quietly
        assert c.get("k") is None and c.set("k", b"w") is False
        assert c.invalidate("k") is False
    c.clear()
    s = c.stats()  # stats while down: the server's numbers as last seen, no exception
    assert s.errors == 16 and s.hits == 1 and s.misses == 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dropped" in warnings[0].getMessage()
    redis_server.start()  # restarted: empty, and the cache uses it again
    assert c.get("k") is None and c.set("k", b"x") and c.get("k") == b"x"
    assert c.stats().errors == 16 and any("answers again" in r.getMessage() for r in caplog.records)
    c.close()


def test_redis_backoff_skips_a_down_server(redis_server):  # noqa: F811
    c = RedisCache(redis_server.url, timeout_s=0.2, backoff_s=3600)
    redis_server.kill()
    assert c.get("k") is None
    redis_server.start()
    assert c.get("k") is None and not c.set("k", b"v")  # not even tried within backoff_s
    assert c.stats().errors == 3 and redis_server.admin().exists("devin:k") == 0
    c.close()


def test_redis_slow_server_times_out(redis_server):  # noqa: F811
    c = RedisCache(redis_server.url, timeout_s=0.1, backoff_s=0.0)
    assert c.set("k", b"v")
    redis_server.admin().execute_command("CLIENT", "PAUSE", 1500, "ALL")  # the server stops answering
    start = time.monotonic()
    assert c.get("k") is None and c.set("k", b"w") is False
    assert time.monotonic() - start < 1.0  # two time-outs of 0.1 s, not the 1.5 s pause
    time.sleep(max(0.0, start + 1.6 - time.monotonic()))
    assert c.stats().errors == 2
    assert c.get("k") == b"v"
    c.close()
