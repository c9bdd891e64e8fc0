"""Automatic prefix caching: stable hashes, collision safety, LRU eviction, HF-exact outputs.

The model tests use one tiny fp32 Llama (block_size 4) and compare every request's greedy
output with HF's greedy loop for that prompt alone. The property test drives the engine with
a stand-in runner whose "KV" slots hold the exact token prefix they were computed from (read
back through the block table), so a falsely shared, stale or overwritten block shows up as a
wrong slot or a wrong output; it also checks the pool accounting after every operation.
"""
from __future__ import annotations

import hashlib
import random
from collections import Counter
from unittest import mock

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile as dc
import devin_compile.runtime.prefix_cache as pc
from devin_compile.config import CacheConfig, OptimizeConfig, SchedulerConfig
from devin_compile.runtime.engine import Engine
from devin_compile.runtime.kv_cache import BlockAllocator, KVCacheExhaustedError, KVCacheSpec, PagedKVCache
from devin_compile.runtime.model_runner import ModelRunner
from devin_compile.runtime.prefix_cache import ROOT, PrefixCache, block_hash, chain_hashes, encode_block
from devin_compile.runtime.runner_protocol import Runner
from devin_compile.runtime.sampling import SamplingParams
from devin_compile.runtime.sequence import Status

VOCAB = 256
BS = 4



# ----------------------------------------------------------------------------------------
# Hash: documented encoding, fixed values


def test_block_hash_is_stable_and_documented():
    assert encode_block(0, [1, 2, 3, 4]).hex() == "00" * 16 + "01000000" "02000000" "03000000" "04000000"
    tokens = list(range(10, 18))
    # literals computed once with the documented encoding; Python's hash() would change per process
    assert chain_hashes(tokens, 4) == [0xbffd92e0b9e0e27f1449c7cfd842bda4, 0x1190f3b51a3692187711765a2725995]
    assert chain_hashes([5, 100000, 7, 2**32 - 1], 4) == [0x7608ff1e053a8f45dd5193c982045d48]
    # the same, re-derived from the spec with xxhash directly
    h = 0
    for j in range(2):
        data = h.to_bytes(16, "little") + b"".join(t.to_bytes(4, "little") for t in tokens[4 * j:4 * j + 4])
        h = xxhash.xxh3_128_intdigest(data)
        assert h == chain_hashes(tokens, 4)[j]
    # chained: the second block's hash depends on the first block's tokens
    assert chain_hashes([9] + tokens[1:], 4)[1] != chain_hashes(tokens, 4)[1]
    assert block_hash(0, tokens[4:]) != chain_hashes(tokens, 4)[1]
    assert chain_hashes(tokens[:7], 4) == chain_hashes(tokens, 4)[:1]  # only full blocks


def test_config_option():
    assert CacheConfig().enable_prefix_caching is True
    assert OptimizeConfig.from_kwargs({"enable_prefix_caching": False}).cache.enable_prefix_caching is False
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        OptimizeConfig.from_kwargs({"enable_prefix_caching": 1})


# ----------------------------------------------------------------------------------------
# Allocator: uncached free blocks first, then cached ones least recently used first


def _register(cache: PrefixCache, block: int, h: int) -> None:
    cache.insert(block, h, ROOT, [h] * cache.block_size)


def test_lru_eviction_order():
    cache = PrefixCache(2)
    alloc = BlockAllocator(6, cache)
    a = alloc.allocate(3)
    b = alloc.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    for blk in (0, 1, 3):
        _register(cache, blk, 100 + blk)
    alloc.free(a)  # tail first: 2 (uncached) → reused first; then 1, 0 become cached-free, 1 older
    alloc.free(b)  # 4 uncached; 3 cached-free, newest
    assert alloc.num_free == 6 and alloc.num_used == 0
    assert alloc.num_cached_free == 3 and len(cache) == 3
    alloc.acquire(1)  # a prefix hit revives block 1 ...
    assert alloc.num_free == 5 and alloc.ref_count[1] == 1 and alloc.num_cached_free == 2
    alloc.free([1])  # ... and freeing it again makes it the most recently used
    assert sorted(alloc.allocate(3)) == [2, 4, 5]  # every uncached block before any cached one
    assert len(cache) == 3 and cache.stats.evictions == 0
    order = []
    for _ in range(3):
        (blk,) = alloc.allocate(1)
        order.append(blk)
        assert blk not in cache and cache.get(100 + blk) is None  # eviction drops the hash entry
    assert order == [0, 3, 1]  # least recently freed first
    assert cache.stats.evictions == 3 and len(cache) == 0 and alloc.num_cached_free == 0
    with pytest.raises(KVCacheExhaustedError):
        alloc.allocate(1)
    alloc.free([0, 3, 1, 2, 4, 5])
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([0])
    with pytest.raises(RuntimeError, match="not cached"):
        alloc.acquire(0)
    assert alloc.peak_used == 6


def test_chain_tail_is_evicted_before_head():
    cache = PrefixCache(2)
    alloc = BlockAllocator(4, cache)
    table = alloc.allocate(4)
    for blk in table:
        _register(cache, blk, 200 + blk)
    alloc.free(table)
    assert [alloc.allocate(1)[0] for _ in range(4)] == table[::-1]


def test_evict_cached_and_check_writable():
    cache = PrefixCache(2)
    alloc = BlockAllocator(3, cache)
    blocks = alloc.allocate(2)
    _register(cache, blocks[0], 1)
    with pytest.raises(AssertionError, match="prefix cache"):
        alloc.check_writable(blocks[0])
    alloc.check_writable(blocks[1])
    alloc.acquire(blocks[0])
    alloc.free(blocks)
    alloc.free(blocks[:1])
    assert alloc.num_cached_free == 1
    assert alloc.evict_cached() == 1 and len(cache) == 0 and alloc.num_cached_free == 0 and alloc.num_free == 3


# ----------------------------------------------------------------------------------------
# Tiny Llama against HF greedy


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def opt(model):
    return dc.optimize(model, num_kv_blocks=64, block_size=BS)


_HF: dict = {}


def hf(model, prompt: list[int], n: int) -> list[int]:
    """HF greedy: n new tokens by full-sequence forwards (memoised)."""
    key = (tuple(prompt), n)
    if key not in _HF:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(n):
                ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        _HF[key] = ids[0, len(prompt):].tolist()
    return _HF[key]


def make_engine(opt, num_blocks: int, *, prefix: bool = True, **sched) -> Engine:
    info = opt.info
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, BS)
    runner = ModelRunner(opt.program, PagedKVCache(spec, num_blocks, info.device), vocab_size=info.vocab_size,
                         backend=opt.engine.runner.backend, device=info.device)
    return Engine(runner, SchedulerConfig(**sched), max_model_len=info.max_model_len,
                  eos_token_ids=info.eos_token_ids, enable_prefix_caching=prefix, debug_checks=True)


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def spy_slots(engine: Engine) -> list[list[int]]:
    """Record every step's slot_mapping and check each written block is exclusive and unregistered."""
    seen: list[list[int]] = []
    run = engine.runner.run
    bs = engine.runner.block_size

    def wrapped(ids, pos, slots, *rest):
        for s in slots:
            engine.kv.allocator.check_writable(s // bs)
        seen.append(list(slots))
        return run(ids, pos, slots, *rest)

    engine.runner.run = wrapped
    return seen


PRE = toks(12, 1000)  # a 3-block preamble


def _two_waves(engine: Engine) -> tuple[list[list[int]], list[str]]:
    wave1 = [PRE + toks(3, 1), PRE + toks(5, 2), list(PRE)]
    wave2 = [PRE + toks(2, 3), PRE + toks(7, 4), list(PRE), wave1[1] + toks(4, 5)]
    rids = [engine.add_request(p, greedy(8)) for p in wave1]
    engine.step()  # wave 1 prefills; its full blocks are registered after the step
    engine.step()
    rids += [engine.add_request(p, greedy(8)) for p in wave2]
    while engine.has_unfinished():
        engine.step()
    return wave1 + wave2, rids


def test_two_waves_share_the_preamble_and_match_hf(opt, model):
    engine = make_engine(opt, 64)
    slots = spy_slots(engine)
    prompts, rids = _two_waves(engine)
    seqs = [engine.requests[r] for r in rids]
    for p, s in zip(prompts, seqs):
        assert s.status is Status.FINISHED and s.output_ids == hf(model, p, 8), len(p)
    hits = [s.metrics.prefix_hit_tokens for s in seqs]
    assert hits[:3] == [0, 0, 0]  # admitted together: nothing registered yet (their copies are folded)
    assert hits[3:] == [12, 12, 8, 16]  # 3 preamble blocks; a preamble-only prompt keeps 1 token to compute
    stats = engine.kv_stats()
    assert stats["prefix_hit_tokens"] == sum(hits) and stats["prefix_deduplicated"] >= 4
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == 64 and stats["blocks_cached"] > 0
    assert stats["blocks_cached_free"] == stats["blocks_cached"]
    assert 0 < stats["prefix_hit_rate"] < 1
    assert slots
    assert engine.reset_prefix_cache() == stats["blocks_cached"]
    assert engine.kv_stats()["blocks_cached"] == 0 and engine.kv_stats()["blocks_free"] == 64
    rid = engine.add_request(PRE + toks(2, 3), greedy(8))  # cold again: no hit, same output
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[rid].metrics.prefix_hit_tokens == 0 and engine.requests[rid].output_ids == seqs[3].output_ids

    plain = make_engine(opt, 64, prefix=False)
    prompts2, rids2 = _two_waves(plain)
    assert [plain.requests[r].output_ids for r in rids2] == [s.output_ids for s in seqs]
    ps = plain.kv_stats()
    assert ps["prefix_hit_tokens"] == 0 and ps["blocks_cached"] == 0
    assert stats["blocks_used_peak"] < ps["blocks_used_peak"]


def test_preemption_and_abort_with_shared_blocks_match_hf(opt, model):
    # 12 blocks of 4: four requests of 8 + 2 + 14 = 24 tokens cannot all run -> preemption
    engine = make_engine(opt, 12)
    spy_slots(engine)
    pre = toks(8, 2000)
    prompts = [pre + toks(2, 10 + i) for i in range(4)]
    first = engine.add_request(prompts[0], greedy(14))
    engine.step()
    rids = [first] + [engine.add_request(p, greedy(14)) for p in prompts[1:]]
    doomed = engine.add_request(pre + toks(3, 99), greedy(14))
    engine.step()
    engine.abort(doomed)
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics.preemptions > 0
    for p, r in zip(prompts, rids):
        s = engine.requests[r]
        assert s.status is Status.FINISHED and s.output_ids == hf(model, p, 14)
    assert engine.requests[doomed].status is Status.ABORTED
    assert sum(engine.requests[r].metrics.prefix_hit_tokens for r in rids) > 8
    st_ = engine.kv_stats()
    assert st_["blocks_used"] == 0 and st_["blocks_free"] == 12


def test_evicted_blocks_are_never_hit(opt, model):
    engine = make_engine(opt, 8)
    a = toks(13, 3000)
    (ra,) = [engine.add_request(a, greedy(3))]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_stats()["blocks_cached"] == 3
    other = toks(28, 3001)  # needs 8 blocks with the output: every cached block is evicted and overwritten
    engine.add_request(other, greedy(4))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.prefix_cache.stats.evictions >= 3
    rb = engine.add_request(a, greedy(3))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[rb].output_ids == hf(model, a, 3) == engine.requests[ra].output_ids
    # OptimizedModel.__call__ allocates straight from the same pool, next to cached blocks
    ids = torch.tensor([toks(30, 3002)])
    with torch.no_grad():
        ref = model(ids).logits
    for _ in range(2):
        opt.generate([a], max_new_tokens=2, ignore_eos=True)
    torch.testing.assert_close(opt(ids).logits, ref, atol=1e-4, rtol=1e-4)
    assert opt.generate([a], max_new_tokens=3, ignore_eos=True) == [hf(model, a, 3)]


@pytest.mark.parametrize("kind", ["constant", "ignores_parent"])
def test_hash_collisions_never_share(opt, model, monkeypatch, kind):
    if kind == "constant":
        monkeypatch.setattr(pc, "block_hash", lambda parent, tokens: 7)
    else:  # the same tokens after different prefixes collide: only the parent link tells them apart
        monkeypatch.setattr(pc, "block_hash", lambda parent, tokens: hash(tuple(tokens)))
    engine = make_engine(opt, 64)
    spy_slots(engine)
    x, y, t, u = toks(4, 1), toks(4, 2), toks(4, 3), toks(4, 4)
    prompts = [x + u + toks(2, 5), y + t + toks(2, 6), x + t + toks(2, 7), y + u + toks(1, 8), x + u + toks(3, 9)]
    rids = []
    for p in prompts:  # one after another, so each sees what the earlier ones registered
        rids.append(engine.add_request(p, greedy(5)))
        while engine.has_unfinished():
            engine.step()
    for p, r in zip(prompts, rids):
        assert engine.requests[r].output_ids == hf(model, p, 5)
    hits = [engine.requests[r].metrics.prefix_hit_tokens for r in rids]
    assert engine.kv.prefix_cache.stats.rejected > 0
    if kind == "constant":
        assert hits == [0, 0, 4, 0, 4]  # only the first registered block (x) can ever be found
    else:
        assert hits == [0, 0, 4, 4, 8]  # x + t: x hits, t (registered after y) is rejected


# ----------------------------------------------------------------------------------------
# Property: random traffic with shared prefixes on a stand-in runner


class PrefixRunner:
    """ModelRunner stand-in: slot ``s`` holds the token prefix whose K/V it would hold.

    Each written slot's value extends the value read from the previous position's slot
    (through the block table), every slot a step attends to is checked to hold exactly this
    sequence's prefix, and the sampled token is a fixed function of the last slot's value.
    """

    vocab_size = 32
    backend = None  # no attention backend (the engine only asks it for KV pruning)
    attention_real_keys = attention_padded_keys = 0  # no padded batched attention

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = PagedKVCache(KVCacheSpec(1, 1, 1, torch.float32, block_size), num_blocks)
        self.block_size = block_size
        self.slots: list[tuple | None] = [None] * (num_blocks * block_size)
        self.engine: Engine | None = None
        self.written_blocks: list[int] = []

    def forward_logits(self, token_ids, block_table):
        """Every position's logits: one-hot on the token that follows its prefix."""
        logits = torch.zeros((len(token_ids), self.vocab_size))
        for p in range(len(token_ids)):
            logits[p, next_token(tuple(token_ids[:p + 1]))] = 1.0
        return logits

    def execute(self, batch, kv_prune=None):
        bs = self.block_size
        alloc = self.engine.kv.allocator
        rows, owners = [], []
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_tokens
            ids, table, start = seq.all_ids, seq.block_table, seq.num_computed

            def slot(p):
                return table[p // bs] * bs + p % bs

            assert n >= 1, "a scheduled sequence must compute at least one token"
            for p in range(start):  # what attention reads: this sequence's own prefix, slot by slot
                assert self.slots[slot(p)] == tuple(ids[:p + 1]), (seq.request_id, p)
            for p in range(start, start + n):
                alloc.check_writable(table[p // bs])
                self.written_blocks.append(table[p // bs])
                prev = self.slots[slot(p - 1)] if p else ()
                self.slots[slot(p)] = prev + (ids[p],)
            if start + n == seq.num_tokens:
                rows.append(next_token(self.slots[slot(start + n - 1)]))
                owners.append(i)
        logits = torch.zeros((max(len(rows), 1), self.vocab_size))
        for r, tok in enumerate(rows):
            logits[r, tok] = 1.0
        return logits[:len(rows)], owners


def next_token(prefix: tuple) -> int:
    return hashlib.blake2b(repr(prefix).encode(), digest_size=2).digest()[0] % PrefixRunner.vocab_size


def oracle(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(tuple(ids)))
    return ids[len(prompt):]


def check_pool(engine: Engine) -> None:
    alloc, cache, sched = engine.kv.allocator, engine.kv.prefix_cache, engine.scheduler
    runner: PrefixRunner = engine.runner
    bs = runner.block_size
    live = [s for s in engine.requests.values() if not s.status.done]
    owners = Counter(b for s in live for b in s.block_table)
    assert all(c >= 0 for c in alloc.ref_count)
    assert all(alloc.ref_count[b] == owners.get(b, 0) for b in range(alloc.num_blocks)), "ref counts ≠ owners"
    free = list(alloc._free)
    assert set(free) == {b for b in range(alloc.num_blocks) if alloc.ref_count[b] == 0}, "block leak"
    assert alloc.num_free + alloc.num_used == alloc.num_blocks == len(free) + len(owners)
    cached_free = [b for b in free if b in cache]
    assert alloc.num_cached_free == len(cached_free)
    assert free[len(free) - len(cached_free):] == cached_free, "uncached free blocks must come first"
    assert all(b in cache for b, c in owners.items() if c > 1), "only registered (full) blocks are shared"
    assert alloc.num_used <= alloc.num_blocks and len(sched.running) <= engine.config.max_num_seqs
    by_id = {e.id: e for e in cache._by_block.values()}
    for b, e in cache._by_block.items():  # every registered block holds exactly its prefix; no orphans
        assert cache.get(e.hash) is e and e.block == b
        content = runner.slots[b * bs + bs - 1]
        assert content is not None and len(content) % bs == 0 and content[-bs:] == e.tokens
        if e.parent != ROOT:
            parent = by_id[e.parent]
            assert runner.slots[parent.block * bs + bs - 1] == content[:-bs]
        else:
            assert len(content) == bs
    for s in live:
        assert len(s.block_table) * bs >= s.num_computed
        chain = engine.kv._chains[s.request_id]
        for j, eid in enumerate(chain.entries):
            assert cache.entry_of(s.block_table[j]).id == eid
    for s in engine.requests.values():
        if s.status.done:
            assert s.block_table == [] and s.request_id not in engine.kv._chains


_PREAMBLES = [[random.Random(7000 + i).randrange(PrefixRunner.vocab_size) for _ in range(12)] for i in range(3)]
# (kind, preamble, preamble length, tail length, new tokens): kind 0-3 add, 4-5 step, 6 abort
_op = st.tuples(st.integers(0, 6), st.integers(0, 2), st.integers(0, 12), st.integers(0, 6), st.integers(1, 10))


def _traffic(test):
    return settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])(given(
        num_blocks=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 5),
        max_batched=st.sampled_from([1, 3, 8, 64]), ops=st.lists(_op, min_size=3, max_size=40),
        seed=st.integers(0, 2**16))(test))


@_traffic
def test_random_shared_prefix_traffic(num_blocks, block_size, max_num_seqs, max_batched, ops, seed):
    run_traffic(num_blocks, block_size, max_num_seqs, max_batched, ops, seed)


def _weak_hash(parent: int, tokens) -> int:
    """Three values, blind to the parent: hash hits are mostly collisions."""
    return sum(tokens) % 3


@_traffic
def test_random_traffic_with_colliding_hash(num_blocks, block_size, max_num_seqs, max_batched, ops, seed):
    with mock.patch.object(pc, "block_hash", _weak_hash):
        run_traffic(num_blocks, block_size, max_num_seqs, max_batched, ops, seed)


def run_traffic(num_blocks, block_size, max_num_seqs, max_batched, ops, seed):
    runner = PrefixRunner(num_blocks, block_size)
    assert isinstance(runner, Runner)  # the stand-in implements the engine's runner interface
    engine = Engine(runner, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched),
                    max_model_len=1000, debug_checks=True)
    runner.engine = engine
    pool = num_blocks * block_size
    rng = random.Random(seed)
    added: list[tuple[str, list[int], int]] = []
    for kind, pre, pre_len, tail, new in ops:
        if kind <= 3:
            prompt = _PREAMBLES[pre][:pre_len] + [rng.randrange(PrefixRunner.vocab_size) for _ in range(tail)]
            if not prompt:
                prompt = [5]
            if len(prompt) + new > pool:
                with pytest.raises(ValueError, match="KV pool"):
                    engine.add_request(prompt, greedy(new))
            else:
                added.append((engine.add_request(prompt, greedy(new)), prompt, new))
        elif kind == 6 and added:
            engine.abort(added[pre_len % len(added)][0])
        else:
            engine.step()
        check_pool(engine)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        check_pool(engine)
    assert not engine.has_unfinished()
    for rid, prompt, new in added:
        seq = engine.requests[rid]
        assert seq.status in (Status.FINISHED, Status.ABORTED), (rid, seq.status, seq.error)
        expected = oracle(prompt, new)
        if seq.status is Status.FINISHED:
            assert seq.output_ids == expected
        else:
            assert seq.output_ids == expected[:len(seq.output_ids)]
        assert seq.metrics.prefix_hit_tokens % block_size == 0
    stats = engine.kv_stats()
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == num_blocks
    assert stats["blocks_cached_free"] == stats["blocks_cached"] <= num_blocks


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_prefix_hits_with_sliding_window_match_hf(family, tiny_model, hf_reference):
    """Hits past a sliding window (mistral: window 12; gemma2: window 7 + soft-capping)."""
    impl = "eager" if family == "gemma2" else "sdpa"
    opt = dc.optimize(tiny_model(family, impl), num_kv_blocks=48, block_size=BS)
    engine = opt.engine
    engine.debug_checks = True
    pre = toks(16, 4000)
    prompts = [pre + toks(3, 41), pre + toks(6, 42), pre + toks(1, 43)]
    first = engine.add_request(prompts[0], greedy(10))
    engine.step()
    rids = [first] + [engine.add_request(p, greedy(10)) for p in prompts[1:]]
    while engine.has_unfinished():
        engine.step()
    for p, r in zip(prompts, rids):
        assert engine.requests[r].output_ids == hf_reference.greedy(family, p, 10)
    assert [engine.requests[r].metrics.prefix_hit_tokens for r in rids] == [0, 16, 16]


def test_allocate_prefers_the_block_after_the_sequence_tail():
    """A growing sequence gets the block right after its last one when that one is free and
    uncached (CPU decode then reads it as one view); otherwise the free list's front."""
    cache = PrefixCache(2)
    alloc = BlockAllocator(8, cache)
    a = alloc.allocate(2)  # [0, 1]
    b = alloc.allocate(1)  # [2]
    assert alloc.allocate(1, after=a[-1]) == [3]  # 2 is taken: front of the free list
    alloc.free(b)
    assert alloc.allocate(2, after=1) == [2, 4]  # 2 is free again; 3 is owned, so then the front
    _register(cache, 5, 505)
    alloc.allocate(1)  # 5 (owned, registered)
    alloc.free([5])  # cached-free now: never taken by adjacency, so its content stays
    assert alloc.allocate(1, after=4) == [6]
    assert alloc.allocate(1, after=7) == [7]  # nothing after the last block: the front
    assert alloc.num_cached_free == 1 and 5 in cache


def test_cpu_pool_is_zeroed_and_writable():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=4)
    pool = PagedKVCache(spec, 5)
    assert pool.data.shape == (2, 2, 5, 4, 2, 8) and pool.data.dtype == torch.bfloat16
    assert pool.nbytes == 5 * spec.bytes_per_block and not pool.data.any()
    k, v = pool.layer(1)
    k[3, 2] = 1.5
    assert pool.data[1, 0, 3, 2].eq(1.5).all() and pool.data.sum().item() == 1.5 * 2 * 8


def test_copy_on_write_release_tail_and_unregister():
    """The allocator / pool methods KV pruning's compaction edits the pool through."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, block_size=2)
    pool = PagedKVCache(spec, 6)
    cache = PrefixCache(2)
    alloc = BlockAllocator(6, cache)
    a = alloc.allocate(3)  # [0, 1, 2]
    alloc.acquire(a[0])  # block 0 shared by a second owner
    pool.data[:, :, a[0]] = 7.0
    assert alloc.is_shared(a[0]) and not alloc.is_shared(a[1])
    copy = alloc.copy_on_write(a[0], pool)
    assert copy not in a and pool.data[:, :, copy].eq(7.0).all()
    assert alloc.ref_count[a[0]] == 1 and alloc.ref_count[copy] == 1  # the other owner keeps block 0
    _register(cache, a[1], 101)
    assert alloc.is_registered(a[1])
    alloc.unregister(a[1])
    assert not alloc.is_registered(a[1]) and a[1] not in cache
    alloc.acquire(a[2])
    assert alloc.num_freed_by([a[1], a[2]]) == 1
    free0 = alloc.num_free
    assert alloc.release_tail([a[1], a[2]]) == 1 and alloc.num_free == free0 + 1
    assert alloc.ref_count[a[2]] == 1
    with pytest.raises(RuntimeError, match="only an owned block"):
        alloc.unregister(a[1])
    # slot moves: gather before, scatter after, by (layer, flat slot)
    table = [copy, a[2]]
    offsets = torch.tensor([0, 3])
    slots = pool.slot_ids(table, offsets)
    assert slots.tolist() == [copy * 2, a[2] * 2 + 1]
    layers = torch.tensor([0, 1])
    pool.data[1, :, a[2], 1] = 3.0
    got = pool.gather_slots(layers, slots)
    assert got.shape == (2, 2, 1, 2) and got[0].eq(7.0).all() and got[1].eq(3.0).all()
    pool.scatter_slots(layers, slots.flip(0), got)
    assert pool.data[0, :, a[2], 1].eq(7.0).all() and pool.data[1, :, copy, 0].eq(3.0).all()
