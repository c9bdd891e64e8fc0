"""Prefix KV tiers under the paged pool (runtime/kv_tiers.py): blocks the pool evicts go to host
memory or Redis and are loaded back instead of recomputed.

Model tests use one tiny seeded fp32 Llama (block_size 4) with a pool too small to keep a 32-token
preamble between requests, and compare every greedy output with HF's greedy loop and with an engine
whose tiers are off. Redis tests run a real redis-server (tests/redis_server.py); nothing mocks
Redis. The property test drives the engine with a stand-in runner whose pool slots hold a hash of
the exact token prefix they were computed from, so a block loaded from a tier with the wrong
content shows up as a wrong slot.
"""
from __future__ import annotations

import functools
import hashlib
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import redis_server  # noqa: F401 (fixture)
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile as dc
from devin_compile.cache import encode_tensor, sampled_state_dict_digest
from devin_compile.cache.config import HostLRUTier, HostTTLTier, RedisTier, coerce
from devin_compile.config import KVPruneConfig, OptimizeConfig, SchedulerConfig
from devin_compile.runtime.engine import Engine
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
from devin_compile.runtime.kv_tiers import KVTiers
from devin_compile.runtime.model_runner import ModelRunner
from devin_compile.runtime.prefix_cache import chain_hashes
from devin_compile.runtime.sampling import SamplingParams
from devin_compile.runtime.sequence import Status

VOCAB = 256
BS = 4
POOL = 12  # blocks of 4: a 39-token request and then a 48-token one cannot both stay cached


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


PRE = toks(32, 1000)  # an 8-block preamble
A, B, C = PRE + toks(3, 1), toks(44, 2), PRE + toks(5, 3)  # B evicts all of A; C shares A's preamble


@functools.lru_cache(maxsize=None)
def tiny_llama() -> LlamaForCausalLM:
    """The same weights in every process (seeded)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.1)  # peaked attention (see conftest)
    return LlamaForCausalLM(cfg).eval()


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def run_one(engine: Engine, prompt: list[int], n: int = 4):
    """Run ``prompt`` to the end, then wait until the write-through tiers have its blocks."""
    rid = engine.add_request(prompt, greedy(n))
    while engine.has_unfinished():
        engine.step()
    if engine.kv.tiers is not None:
        assert engine.kv.tiers.flush(30)
    return engine.requests[rid]


_HF: dict = {}


def hf(prompt: list[int], n: int = 4) -> list[int]:
    key = (tuple(prompt), n)
    if key not in _HF:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(n):
                ids = torch.cat([ids, tiny_llama()(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        _HF[key] = ids[0, len(prompt):].tolist()
    return _HF[key]


@pytest.fixture(scope="module")
def opt():
    return dc.optimize(tiny_llama(), num_kv_blocks=POOL, block_size=BS)


def make_engine(opt, tiers=None, num_blocks: int = POOL) -> Engine:
    info = opt.info
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, BS)
    pool = PagedKVCache(spec, num_blocks, info.device)
    runner = ModelRunner(opt.program, pool, vocab_size=info.vocab_size, backend=opt.engine.runner.backend,
                         device=info.device)
    kv_tiers = None
    if tiers:
        kv_tiers = KVTiers.for_model(coerce(tiers), pool, weights_digest=sampled_state_dict_digest(
            tiny_llama().state_dict()))
    return Engine(runner, SchedulerConfig(), max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
                  debug_checks=True, kv_tiers=kv_tiers)


def value_bytes(opt) -> int:
    """Bytes one tiny-Llama block takes in a host tier (key + encoded value)."""
    e = make_engine(opt, [{"backend": "host_lru", "max_bytes": 1 << 20}])
    return len(e.kv.tiers.key(1)) + len(e.kv.tiers.codec.encode(e.runner.kv_cache.data[:, :, 0]))


def assert_same_kv(engine: Engine, ref: Engine, tokens: list[int]) -> None:
    """The K/V every full block of ``tokens`` has in ``engine``'s pool equal those ``ref`` computed."""
    for h in chain_hashes(tokens, BS):
        a, b = engine.kv.prefix_cache.get(h), ref.kv.prefix_cache.get(h)
        assert a is not None and b is not None
        torch.testing.assert_close(engine.runner.kv_cache.data[:, :, a.block], ref.runner.kv_cache.data[:, :, b.block],
                                   atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# The preamble is evicted from the pool and restored from a tier


def _tiers(kind: str, url: str | None, block: int) -> list[dict]:
    return {"host_lru": [{"backend": "host_lru", "max_bytes": 1 << 20}],
            "redis": [{"backend": "redis", "url": url}],
            "redis-on-eviction": [{"backend": "redis", "url": url, "write_through": False}],
            # three blocks fit the host tier: the other five are loaded from Redis (and promoted)
            "host_ttl+redis": [{"backend": "host_ttl", "max_bytes": 3 * block, "ttl_s": 600},
                               {"backend": "redis", "url": url}]}[kind]


@pytest.mark.parametrize("kind", ["host_lru", "redis", "redis-on-eviction", "host_ttl+redis"])
def test_evicted_preamble_is_restored_from_a_tier(opt, kind, request):
    url = request.getfixturevalue("redis_server").url if "redis" in kind else None
    engine = make_engine(opt, _tiers(kind, url, value_bytes(opt)))
    plain = make_engine(opt)
    seqs = [run_one(engine, p) for p in (A, B, C)]
    ref = [run_one(plain, p) for p in (A, B, C)]
    assert [s.output_ids for s in seqs] == [r.output_ids for r in ref] == [hf(p) for p in (A, B, C)]
    assert [s.metrics.tier_hit_tokens for s in seqs] == [0, 0, 32]  # every preamble block was loaded
    assert seqs[2].metrics.prefix_hit_tokens == 0 and seqs[2].status is Status.FINISHED
    assert_same_kv(engine, plain, PRE)  # what was loaded is what the plain engine computed
    stats = engine.kv_stats()
    tiers = stats["kv_tiers"]
    assert stats["kv_tier_loaded_tokens"] == 32 and stats["kv_tier_hits"] == 8 == sum(t["hits"] for t in tiers)
    assert stats["kv_tier_published_blocks"] >= 9 and stats["kv_tier_rejected"] == 0
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == POOL
    for t in tiers:
        assert t["max_bytes"] is None or t["bytes"] <= t["max_bytes"]
        assert t["load_ms"] >= 0 and t["errors"] == 0
    if kind == "host_ttl+redis":
        assert tiers[0]["hits"] > 0 and tiers[1]["hits"] > 0
    assert plain.kv_stats().get("kv_tiers") is None
    # the loaded blocks are registered like computed ones: the next request hits them in the pool
    again = run_one(engine, PRE + toks(2, 4))
    assert again.metrics.prefix_hit_tokens == 32 and again.output_ids == hf(PRE + toks(2, 4))


def test_optimize_option_and_stats(redis_server):  # noqa: F811
    opt2 = dc.optimize(tiny_llama(), num_kv_blocks=POOL, block_size=BS,
                       kv_cache_tiers=[{"backend": "host_lru", "max_bytes": 1 << 20},
                                       {"backend": "redis", "url": redis_server.url, "ttl_s": 60}])
    seqs = [run_one(opt2.engine, p) for p in (A, B, C)]
    assert [s.output_ids for s in seqs] == [hf(p) for p in (A, B, C)]
    assert seqs[2].metrics.tier_hit_tokens == 32
    tiers = opt2.engine.kv_stats()["kv_tiers"]
    assert [t["backend"] for t in tiers] == ["host_lru", "redis"] and tiers[0]["hits"] == 8
    assert tiers[1]["entries"] >= 9 and 0 < redis_server.admin().pttl(redis_server.admin().keys("devin:kv:*")[0]) <= 60_000


# ----------------------------------------------------------------------------------------
# Redis: tampered values, a server killed mid-run (another process: test_kv_write_through.py)

@pytest.mark.parametrize("tamper,block", [("truncated", 2), ("shape", 5), ("fingerprint", 0)])
def test_tampered_value_in_redis_is_rejected_and_recomputed(opt, redis_server, tamper, block):  # noqa: F811
    engine = make_engine(opt, [{"backend": "redis", "url": redis_server.url}])
    run_one(engine, A)
    run_one(engine, B)
    admin = redis_server.admin()
    key = b"devin:" + engine.kv.tiers.key(chain_hashes(PRE, BS)[block]).encode()
    value = admin.get(key)
    assert value is not None
    good = engine.kv.tiers.codec.decode(value)
    bad = {"truncated": value[:-7],
           "shape": encode_tensor(good[:, :, :2].contiguous(), engine.kv.tiers.fingerprint),
           "fingerprint": encode_tensor(good, "another-model")}[tamper]
    admin.set(key, bad)
    seq = run_one(engine, C)
    assert seq.output_ids == hf(C)
    assert seq.metrics.tier_hit_tokens == BS * block  # the blocks before the bad one were loaded
    stats = engine.kv_stats()
    assert stats["kv_tier_rejected"] == 1 == stats["kv_tiers"][0]["rejected"]
    assert not admin.exists(key) or admin.get(key) != bad  # dropped (C's own block may be published again)


def test_redis_killed_mid_run_every_request_finishes(opt, redis_server):  # noqa: F811
    engine = make_engine(opt, [{"backend": "redis", "url": redis_server.url, "timeout_s": 0.5}])
    run_one(engine, A)
    run_one(engine, B)
    wave1 = [C, PRE + toks(7, 5)]
    wave2 = [PRE + toks(2, 6), toks(30, 7), A]
    rids = [engine.add_request(p, greedy(6)) for p in wave1]
    engine.step()  # wave 1 loads the preamble from Redis
    redis_server.kill()
    rids += [engine.add_request(p, greedy(6)) for p in wave2]
    for _ in range(3):
        engine.step()
    run_one(engine, toks(40, 8))  # evicts: the blocks it publishes are dropped
    run_one(engine, PRE + toks(4, 9))  # the lookup misses: computed
    for p, r in zip(wave1 + wave2, rids):
        s = engine.requests[r]
        assert s.status is Status.FINISHED and s.output_ids == hf(p, 6)
    assert engine.requests[rids[0]].metrics.tier_hit_tokens == 32
    stats = engine.kv_stats()
    assert stats["kv_tiers"][0]["errors"] > 0 and stats["blocks_used"] == 0


# ----------------------------------------------------------------------------------------
# Options, pruning, keys


def test_tier_options_are_validated():
    assert coerce(None) is None and coerce([]) is None
    tiers = OptimizeConfig.from_kwargs({"kv_cache_tiers": [
        {"backend": "host_lru", "max_bytes": 2 << 30}, {"backend": "host_ttl", "max_bytes": 1 << 20, "ttl_s": 5},
        {"backend": "redis", "url": "redis://127.0.0.1:6379/0", "ttl_s": 3600}]}).kv_cache_tiers
    assert [type(t) for t in tiers] == [HostLRUTier, HostTTLTier, RedisTier] and tiers[2].ttl_s == 3600
    assert [t.write_through for t in tiers] == [False, False, True]  # the defaults: only Redis is written through
    bad = [
        ([{"backend": "disk"}], r"backend='disk' is unknown; valid backends: \['host_lru', 'host_ttl', 'redis'\]"),
        ([{"backend": "host_lru", "maxbytes": 1}],
         r"unknown keys \['maxbytes'\]; valid keys: \['max_bytes', 'write_through', 'backend'\]"),
        ([{"backend": "host_lru", "max_bytes": 1, "write_through": "yes"}],
         r"host_lru\]\.write_through='yes' must be True or False"),
        ([{"backend": "host_ttl", "max_bytes": 1, "ttl_s": 1, "write_through": 1}], r"write_through=1 must be True"),
        ([{"backend": "redis", "url": "redis://x", "write_through": None}], r"redis\]\.write_through=None"),
        ([{"backend": "host_ttl", "max_bytes": 1}], r"needs \['ttl_s'\]"),
        ([{"backend": "host_lru", "max_bytes": -1}], r"max_bytes=-1 must be a positive integer"),
        ([{"backend": "redis", "url": "redis://x"}, {"backend": "host_lru", "max_bytes": 1}], "must come last"),
        ([{"backend": "redis", "url": "http://x"}], "must be a redis://"),
        ([{"backend": "redis", "url": "redis://x", "ttl_s": 0}], "ttl_s=0"),
        ({"backend": "host_lru", "max_bytes": 1}, "must be a list"),
        (["host_lru"], "must be a dict"),
    ]
    for value, match in bad:
        with pytest.raises(ValueError, match=match):
            OptimizeConfig.from_kwargs({"kv_cache_tiers": value})


def test_tiers_need_prefix_caching_and_their_own_pool(opt):
    info = opt.info
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, BS)
    pool = PagedKVCache(spec, 4)
    runner = ModelRunner(opt.program, pool, vocab_size=info.vocab_size, device=info.device)
    tiers = KVTiers(coerce([{"backend": "host_lru", "max_bytes": 1 << 16}]), pool, "fp")
    with pytest.raises(ValueError, match="prefix caching"):
        Engine(runner, SchedulerConfig(), max_model_len=64, enable_prefix_caching=False, kv_tiers=tiers)
    other = KVTiers(coerce([{"backend": "host_lru", "max_bytes": 1 << 16}]), PagedKVCache(spec, 4), "fp")
    with pytest.raises(ValueError, match="pool"):
        Engine(runner, SchedulerConfig(), max_model_len=64, kv_tiers=other)


def test_fingerprint_names_weights_dtype_and_block_size():
    model = tiny_llama()
    digest = sampled_state_dict_digest(model.state_dict())
    assert digest == sampled_state_dict_digest(dict(reversed(list(model.state_dict().items()))))
    edited = {k: v.clone() for k, v in model.state_dict().items()}
    edited["lm_head.weight"][0, 0] += 1  # a sampled element (the first of the first tensor)
    assert sampled_state_dict_digest(edited) != digest
    tiers = coerce([{"backend": "host_lru", "max_bytes": 1 << 16}])

    def fp(dtype=torch.float32, block_size=4, **facts):
        pool = PagedKVCache(KVCacheSpec(2, 2, 16, dtype, block_size), 2)
        return KVTiers.for_model(tiers, pool, weights_digest=digest, **facts).fingerprint

    assert len({fp(), fp(torch.bfloat16), fp(block_size=8), fp(quantization="int4"), fp(model_config="x")}) == 5
    assert fp() == fp()


# ----------------------------------------------------------------------------------------
# Property: random traffic on a stand-in runner, tiers on


def _chain(ids: list[int]) -> list[int]:
    """Slot value of each position: a 62-bit hash of the token prefix up to and including it."""
    out, h = [], b""
    for t in ids:
        h = hashlib.blake2b(h + t.to_bytes(4, "little"), digest_size=8).digest()
        out.append(int.from_bytes(h, "little") >> 2)
    return out


class PrefixHashRunner:
    """ModelRunner stand-in over a real int64 pool: slot ``s`` holds the hash of the token prefix whose
    K/V it would hold (K) and the token (V). Every slot a step reads is checked against the sequence's
    own prefix, so a block loaded from a tier with other content fails the run."""

    vocab_size = 32
    backend = None
    attention_real_keys = attention_padded_keys = 0

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = PagedKVCache(KVCacheSpec(1, 1, 1, torch.int64, block_size), num_blocks)
        self.engine: Engine | None = None

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def forward_logits(self, token_ids, block_table):
        raise NotImplementedError

    def execute(self, batch, kv_prune=None):
        bs = self.block_size
        k, v = (t.view(-1) for t in self.kv_cache.layer(0))
        rows, owners = [], []
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_tokens
            ids, table, start = seq.all_ids, seq.block_table, seq.num_computed
            want = _chain(ids)
            slots = [table[p // bs] * bs + p % bs for p in range(start + n)]
            assert k[slots[:start]].tolist() == want[:start] and v[slots[:start]].tolist() == ids[:start], seq.request_id
            for p in range(start, start + n):
                self.engine.kv.allocator.check_writable(table[p // bs])
                k[slots[p]], v[slots[p]] = want[p], ids[p]
            if start + n == seq.num_tokens:
                rows.append(want[start + n - 1] % self.vocab_size)
                owners.append(i)
        logits = torch.zeros((len(rows), self.vocab_size))
        for r, tok in enumerate(rows):
            logits[r, tok] = 1.0
        return logits, owners


def oracle(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(_chain(ids)[-1] % PrefixHashRunner.vocab_size)
    return ids[len(prompt):]


def check(engine: Engine) -> None:
    alloc = engine.kv.allocator
    live = [s for s in engine.requests.values() if not s.status.done]
    owners = Counter(b for s in live for b in s.block_table)
    assert all(alloc.ref_count[b] == owners.get(b, 0) for b in range(alloc.num_blocks)), "ref counts ≠ owners"
    assert set(alloc._free) == {b for b in range(alloc.num_blocks) if alloc.ref_count[b] == 0}, "block leak"
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    for tier in engine.kv.tiers.tiers:
        assert tier.stats().bytes <= tier.max_bytes, "a tier outgrew its bound"


def make_stub_engine(num_blocks, block_size, max_num_seqs, max_batched, lru_bytes, ttl_bytes) -> Engine:
    runner = PrefixHashRunner(num_blocks, block_size)
    tiers = KVTiers(coerce([{"backend": "host_lru", "max_bytes": lru_bytes},
                            {"backend": "host_ttl", "max_bytes": ttl_bytes, "ttl_s": 3600}]), runner.kv_cache, "stub")
    engine = Engine(runner, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched),
                    max_model_len=1000, debug_checks=True, kv_tiers=tiers)
    runner.engine = engine
    return engine


_PREAMBLES = [[random.Random(7000 + i).randrange(32) for _ in range(16)] for i in range(3)]
# (kind, preamble, preamble length, tail length, new tokens): kind 0-3 add, 4-5 step, 6 abort
_op = st.tuples(st.integers(0, 6), st.integers(0, 2), st.integers(4, 16), st.integers(0, 4), st.integers(1, 6))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 4),
       max_batched=st.sampled_from([3, 8, 64]), lru_bytes=st.integers(100, 1500), ttl_bytes=st.integers(100, 3000),
       ops=st.lists(_op, min_size=8, max_size=40), seed=st.integers(0, 2**16))
def test_random_traffic_with_tiers(num_blocks, block_size, max_num_seqs, max_batched, lru_bytes, ttl_bytes, ops,
                                   seed):
    engine = make_stub_engine(num_blocks, block_size, max_num_seqs, max_batched, lru_bytes, ttl_bytes)
    pool = num_blocks * block_size
    rng = random.Random(seed)
    added: list[tuple[str, list[int], int]] = []
    for kind, pre, pre_len, tail, new in ops:
        if kind <= 3:
            prompt = _PREAMBLES[pre][:pre_len] + [rng.randrange(32) for _ in range(tail)] or [5]
            if len(prompt) + new <= pool:
                added.append((engine.add_request(prompt, greedy(new)), prompt, new))
        elif kind == 6 and added:
            engine.abort(added[pre_len % len(added)][0])
        else:
            engine.step()
        check(engine)
    for replay in (False, True):  # then every prompt again: their evicted prefixes come from the tiers
        if replay:
            added += [(engine.add_request(p, greedy(n)), p, n) for _, p, n in added[:8]]
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            engine.step()
            check(engine)
        assert not engine.has_unfinished()
    for rid, prompt, new in added:
        seq = engine.requests[rid]
        expected = oracle(prompt, new)
        assert seq.output_ids == (expected if seq.status is Status.FINISHED else expected[:len(seq.output_ids)])
        assert seq.metrics.tier_hit_tokens % block_size == 0
    stats = engine.kv_stats()
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == num_blocks and stats["kv_tier_rejected"] == 0


def test_stub_traffic_loads_from_both_tiers_and_pruning_sequences_never_publish():
    engine = make_stub_engine(8, 2, 2, 64, lru_bytes=400, ttl_bytes=4000)
    pre = _PREAMBLES[0][:10]
    seqs = [run_one(engine, p, 2) for p in (pre + [1], list(range(14)), pre + [2])]
    assert [s.output_ids for s in seqs] == [oracle(s.prompt_ids, 2) for s in seqs]
    assert seqs[2].metrics.tier_hit_tokens == 10
    tiers = engine.kv_stats()["kv_tiers"]
    assert tiers[0]["hits"] > 0 and tiers[1]["hits"] > 0 and tiers[0]["evictions"] > 0
    # a KV-pruning sequence's blocks are registered (shared in the pool) but never published
    engine = make_stub_engine(8, 2, 2, 64, lru_bytes=4000, ttl_bytes=4000)
    rid = engine.add_request(pre + [3], greedy(2))
    engine.requests[rid].kv_prune_config = KVPruneConfig()
    while engine.has_unfinished():
        engine.step()
    assert len(engine.kv.prefix_cache) > 0
    run_one(engine, list(range(15)), 1)  # evicts them
    stats = engine.kv_stats()
    assert stats["kv_tier_skipped_pruned"] > 0 and stats["kv_tier_published_blocks"] == 0
    assert run_one(engine, pre + [3], 2).metrics.tier_hit_tokens == 0
