"""Speculative decoding: lossless greedy output for every proposer, KV rollback without
leaks, rejection sampling that keeps the target's distribution, adaptive length, recompute on
non-finite logits, hot swap, and clear errors for bad settings."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import devin_compile
from devin_compile.config import SpeculativeConfig
from devin_compile.runtime.sampling import SamplingParams
from devin_compile.runtime.speculative import Draft, SpecState, accept_sampled
from devin_compile.runtime.speculative.ngram import lookup
from devin_compile.runtime.speculative.factory import layer_view

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],  # repeats: the n-gram proposer finds matches
    [11, 12, 13, 11, 12],
    list(range(20, 47)),
]
NEW = 20


def _greedy(opt, prompts=PROMPTS, **kw):
    outs = opt.engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, **kw))
    return [o.output_ids for o in outs]


def _no_leak(opt):
    eng = opt.engine
    assert eng.kv.allocator.num_used == 0, "target blocks still held after every request finished"
    if eng.spec is not None and hasattr(eng.spec.proposer, "allocator"):
        assert eng.spec.proposer.allocator.num_used == 0, "draft blocks still held"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
def test_ngram_greedy_identical(tiny_model, family):
    model = tiny_model(family)
    kw = dict(num_kv_blocks=64, block_size=4)
    ref = _greedy(devin_compile.optimize(model, **kw))
    opt = devin_compile.optimize(model, speculative={"method": "ngram", "num_tokens": 4}, **kw)
    opt.engine.debug_checks = True  # every step asserts it writes no shared or registered block
    assert _greedy(opt) == ref
    stats = opt.engine.spec_stats()
    assert stats["drafted"] > 0 and stats["steps"] > 0
    _no_leak(opt)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_head_and_draft_greedy_identical(tiny_model, family):
    model = tiny_model(family)
    kw = dict(num_kv_blocks=64, block_size=4)
    ref = _greedy(devin_compile.optimize(model, **kw))
    head = devin_compile.optimize(model, speculative={"method": "head", "layers": 1}, **kw)
    assert _greedy(head) == ref
    assert head.engine.spec_stats()["drafted"] > 0
    _no_leak(head)
    same = devin_compile.optimize(model, speculative={"method": "draft", "model": model, "num_tokens": 3}, **kw)
    assert _greedy(same) == ref
    st_ = same.engine.spec_stats()
    assert st_["acceptance_rate"] == 1.0, "a draft equal to the target must have every proposal accepted"
    _no_leak(same)


def test_random_draft_low_acceptance_same_output(tiny_model):
    model = tiny_model("llama")
    other = tiny_model("llama", seed=7)  # same vocabulary, unrelated weights
    kw = dict(num_kv_blocks=64, block_size=4)
    ref = _greedy(devin_compile.optimize(model, **kw))
    opt = devin_compile.optimize(model, speculative={"method": "draft", "model": other, "adaptive": False}, **kw)
    assert _greedy(opt) == ref
    assert opt.engine.spec_stats()["acceptance_rate"] < 0.2
    _no_leak(opt)


def test_preemption_and_prefix_caching_keep_output(tiny_model):
    """A pool too small for all requests at once: preemptions happen while speculating."""
    model = tiny_model("llama")
    prompts = [[3, 4, 5, 6, 7, 8, 9, 3, 4, 5] + [30 + i] * 3 for i in range(4)]  # shared prefix
    ref = _greedy(devin_compile.optimize(model, num_kv_blocks=64, block_size=4), prompts)
    opt = devin_compile.optimize(model, num_kv_blocks=16, block_size=4, speculative={"method": "ngram"})
    opt.engine.debug_checks = True
    assert _greedy(opt, prompts) == ref
    assert opt.engine.metrics.preemptions > 0
    assert opt.engine.kv_stats()["prefix_hit_tokens"] > 0
    _no_leak(opt)


class ScriptedProposer:
    """Proposes the reference continuation or a wrong token at each position, as ``rng`` says."""

    name = "scripted"

    def __init__(self, reference: dict[tuple, list[int]], rng: random.Random, vocab: int) -> None:
        self.reference, self.rng, self.vocab = reference, rng, vocab

    def propose(self, requests):
        out = []
        for r in requests:
            ref = self.reference[tuple(r.seq.prompt_ids)]
            p = len(r.seq.output_ids)
            toks = []
            for i in range(self.rng.randint(0, r.num_tokens)):
                good = ref[p + i] if p + i < len(ref) else 0
                toks.append(good if self.rng.random() < 0.7 else (good + 1) % self.vocab)
            out.append(Draft(toks))
        return out

    def release(self, seq):
        pass


@pytest.fixture(scope="module")
def scripted_setup(tiny_model):
    model = tiny_model("llama")
    prompts = [[3, 4, 5, 6, 7, 8, 9, 3] + [40 + i] * (1 + i) for i in range(4)]
    plain = devin_compile.optimize(model, num_kv_blocks=64, block_size=4)
    ref = {tuple(p): o for p, o in zip(prompts, _greedy(plain, prompts))}
    opt = devin_compile.optimize(model, num_kv_blocks=14, block_size=4)
    return model, prompts, ref, plain, opt


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5))
def test_random_accept_reject_leaks_nothing(scripted_setup, seed, k):
    model, prompts, ref, plain, opt = scripted_setup
    eng = opt.engine
    eng.set_proposer(ScriptedProposer(ref, random.Random(seed), model.config.vocab_size),
                     SpeculativeConfig(num_tokens=k, adaptive=False))
    eng.debug_checks = True
    assert _greedy(opt, prompts) == [ref[tuple(p)] for p in prompts]
    assert eng.kv.allocator.num_used == 0
    # every registered block holds verified tokens with the K/V plain decoding computes for them
    bs = 4
    chunks = {}
    for p in prompts:
        ids = p + ref[tuple(p)]
        for j in range(len(ids) // bs):
            chunks[tuple(ids[j * bs:(j + 1) * bs])] = True
    plain_cache = plain.engine.kv.prefix_cache
    for block, entry in list(eng.kv.prefix_cache._by_block.items()):
        assert entry.tokens in chunks, "an unverified token reached the prefix cache"
        twin = plain_cache.get(entry.hash)
        if twin is not None:
            a = eng.runner.kv_cache.data[:, :, block]
            b = plain.engine.runner.kv_cache.data[:, :, twin.block]
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_rejection_sampler_keeps_target_distribution():
    """On a 5-token vocabulary the first emitted token follows p, whatever q proposed."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.05, 0.1, 0.4, 0.4]])
    other = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.4])

    def empirical(n: int, deterministic: bool) -> torch.Tensor:
        counts = torch.zeros(5)
        for _ in range(n):
            if deterministic:  # an n-gram style proposal: always token 3, q one-hot
                first = accept_sampled(p, [3], None, g)[0]
            else:
                x = int(torch.multinomial(q[0], 1, generator=g))
                first = accept_sampled(p, [x], q, g)[0]
            counts[first] += 1
        return counts / n

    for deterministic in (False, True):
        d_small = (empirical(300, deterministic) - p[0]).abs().sum()
        d_large = (empirical(6000, deterministic) - p[0]).abs().sum()
        d_other = (empirical(6000, deterministic) - other).abs().sum()
        assert d_large < d_small or d_large < 0.03
        assert d_large < 0.06 < d_other


def test_sampling_is_seeded_and_runs(tiny_model):
    model = tiny_model("llama")
    opt = devin_compile.optimize(model, num_kv_blocks=64, block_size=4, speculative={"method": "ngram"})
    kw = dict(do_sample=True, temperature=0.8, top_k=20, seed=123)
    a = _greedy(opt, **kw)
    b = _greedy(opt, **kw)
    assert a == b
    assert opt.engine.spec_stats()["drafted"] > 0
    _no_leak(opt)


def test_per_request_override_and_off(tiny_model):
    model = tiny_model("llama")
    opt = devin_compile.optimize(model, num_kv_blocks=64, block_size=4, speculative={"method": "ngram"})
    outs = opt.engine.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=NEW, ignore_eos=True, speculative=False),
                                             SamplingParams(max_new_tokens=NEW, ignore_eos=True,
                                                            speculative={"num_tokens": 6, "adaptive": False})])
    assert outs[0].metrics.spec is None
    spec = outs[1].metrics.spec
    assert spec is not None and max(len(spec.proposed_at), 1) <= 6
    table = opt.engine.spec_stats()["requests"]
    assert [r["request_id"] for r in table] == [outs[1].request_id]


def test_adaptive_rule():
    s = SpecState(proposer=object(), max_tokens=4, threshold=0.0, adaptive=True)
    s.update(4, 4)
    assert s.num_tokens == 4
    s.update(4, 1)
    assert s.num_tokens == 3
    for _ in range(4):
        s.update(3, 0)
    assert s.wanted() == 0, "low acceptance pauses proposals"
    while s.cooldown:
        s.wanted()
    assert s.wanted() > 0, "and probes again after the back-off"
    b = s.backoff
    s.update(3, 0)
    assert (s.cooldown, s.backoff) == (b, 2 * b), "a probe that misses again pauses at once, twice as long"
    while s.cooldown:
        s.wanted()
    s.update(3, 3)
    assert s.cooldown == 0 and s.backoff == b, "an accepting probe resumes and halves the back-off"


def test_batch_turns_speculation_down(tiny_model):
    model = tiny_model("llama")
    opt = devin_compile.optimize(model, num_kv_blocks=256, block_size=4,
                                 speculative={"method": "ngram", "max_verify_tokens": 16})
    prompts = [PROMPTS[0]] * 16
    opt.engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert opt.engine.spec_stats()["drafted"] == 0, "16 sequences x (1 + k) > 16 verify tokens: no proposals"
    assert opt.engine.spec_stats()["turned_down_steps"] > 0


def test_nan_logits_recompute_then_fail_alone(tiny_model, monkeypatch):
    model = tiny_model("llama")
    opt = devin_compile.optimize(model, num_kv_blocks=64, block_size=4, speculative={"method": "ngram"})
    ref = _greedy(devin_compile.optimize(model, num_kv_blocks=64, block_size=4))
    runner = opt.engine.runner
    real = runner.execute
    state = {"left": 2}

    def flaky(batch, kv_prune=None):
        logits, owners = real(batch, kv_prune)
        if state["left"] and any(it.draft for it in batch):
            state["left"] -= 1
            logits = logits.clone()
            logits[0, 0] = float("nan")
        return logits, owners

    monkeypatch.setattr(runner, "execute", flaky)
    assert _greedy(opt) == ref
    assert opt.engine.spec_stats()["recomputes"] == 2

    bad = set()

    def poisoned(batch, kv_prune=None):  # request 0's verify rows are always NaN
        logits, owners = real(batch, kv_prune)
        logits = logits.clone()
        for row, i in enumerate(owners):
            if batch[i].draft and batch[i].seq.prompt_ids == PROMPTS[0]:
                logits[row] = float("nan")
                bad.add(batch[i].seq.request_id)
        return logits, owners

    monkeypatch.setattr(runner, "execute", poisoned)
    outs = opt.engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert outs[0].error and "not finite" in outs[0].error
    assert [o.output_ids for o in outs[1:]] == ref[1:]
    _no_leak(opt)


def test_hot_swap_under_load(tiny_model):
    model = tiny_model("llama")
    other = tiny_model("llama", seed=3)
    kw = dict(num_kv_blocks=64, block_size=4)
    ref = _greedy(devin_compile.optimize(model, **kw))
    opt = devin_compile.optimize(model, speculative={"method": "draft", "model": other}, **kw)
    eng = opt.engine
    old = eng.spec.proposer
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = [eng.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(3):
        eng.step()
    opt.set_draft({"method": "head", "layers": 1})
    new = eng.spec.proposer
    assert new is not old and new.name == "head"
    late = eng.add_request(PROMPTS[2], params)
    assert all(eng.requests[r].spec.proposer is old for r in first)
    assert eng.requests[late].spec.proposer is new
    while eng.has_unfinished():
        eng.step()
    assert [eng.requests[r].output_ids for r in first + [late]] == ref
    _no_leak(opt)
    assert old.allocator.num_used == 0


def test_layer_view_shares_weights(tiny_model):
    model = tiny_model("llama")
    view = layer_view(model, [0])
    assert view.config.num_hidden_layers == 1 and model.config.num_hidden_layers == 2
    assert view.model.layers[0] is model.model.layers[0]
    assert view.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert len(model.model.layers) == 2


@pytest.mark.parametrize("spec, match", [
    ({"method": "medusa"}, "speculative.method"),
    ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens"),
    ({"method": "draft"}, "needs model="),
    ({"method": "head", "layers": 2}, "fewer than the target"),
    ({"method": "ngram", "bogus": 1}, "unknown keys"),
])
def test_bad_settings_raise_before_work(tiny_model, spec, match):
    with pytest.raises(ValueError, match=match):
        devin_compile.optimize(tiny_model("llama"), speculative=spec)


def test_draft_with_other_vocabulary_is_rejected(tiny_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="vocabulary"):
        devin_compile.optimize(tiny_model("llama"), speculative={"method": "draft", "model": small})


PRUNE = {"threshold": 0.5, "max_tokens": 24, "step_interval": 6, "sink_tokens": 2, "recent_tokens": 4, "pool_kernel": 1,
         "recency_layers": 0.0}


@pytest.mark.parametrize("method", [{"method": "ngram", "num_tokens": 4}, {"method": "head", "layers": 1}])
def test_kv_pruning_with_speculation_keeps_pruned_greedy_output(tiny_model, method):
    """A pruning request speculates between evaluations; only verified rows are scored, so its
    evictions and tokens are those of plain decoding with the same pruning."""
    model = tiny_model("llama")
    prompts = [PROMPTS[0] + PROMPTS[0], list(range(20, 50))]  # same length: the steps stay pure decode steps
    kw = dict(num_kv_blocks=64, block_size=4, kv_prune=PRUNE)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = devin_compile.optimize(model, **kw)
    ref = [o.output_ids for o in plain.engine.generate(prompts, params)]
    evicted = plain.engine.kv_stats()["kv_prune_evicted_tokens"]
    opt = devin_compile.optimize(model, speculative=method, **kw)
    opt.engine.debug_checks = True
    assert [o.output_ids for o in opt.engine.generate(prompts, params)] == ref
    assert opt.engine.spec_stats()["drafted"] > 0
    assert evicted > 0 and opt.engine.kv_stats()["kv_prune_evicted_tokens"] == evicted
    _no_leak(opt)


def test_bad_request_settings(tiny_model):
    with pytest.raises(ValueError, match="SamplingParams.speculative"):
        SamplingParams(speculative={"num_token": 2})
    opt = devin_compile.optimize(tiny_model("llama"), num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="no speculative decoding"):
        opt.engine.add_request([1, 2, 3], SamplingParams(speculative={"num_tokens": 2}))


def test_ngram_lookup():
    t = torch.tensor([1, 2, 3, 4, 9, 1, 2, 3])
    assert lookup(t, 3, 1, 4) == [4, 9, 1]
    assert lookup(torch.tensor([5, 6, 7]), 3, 1, 4) == []
