"""KV-cache pruning: identity at threshold 0, positions, protected windows, pages, leaks.

The oracle for positions is a *masking reference*: the same model, unpruned, whose attention
(a test backend) masks exactly the tokens the pruned run had evicted in each layer at each
step, without moving anything. Equal logits mean that compaction kept the right K/V, with
their true rotary positions, that new tokens continue from the true position, and that no
evicted slot is read again.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile as dc
from devin_compile.backends.attention.kv_write import gather_sequence, write_kv
from devin_compile.backends.attention.registry import get_backend
from devin_compile.config import KVPruneConfig, SchedulerConfig
from devin_compile.pipeline import PassError
from devin_compile.runtime.engine import Engine
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
from devin_compile.runtime.model_runner import ModelRunner
from devin_compile.runtime.sampling import SamplingParams

VOCAB = 256


def tiny_llama(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def base(model):
    return dc.optimize(model, num_kv_blocks=96, block_size=4)


@pytest.fixture(scope="module")
def pruned(model):
    """Pruning nodes compiled in, pruning off by default (requests turn it on)."""
    return dc.optimize(model, num_kv_blocks=96, block_size=4, kv_prune={"enabled": False})


def engine_over(opt, *, num_blocks=96, backend=None, prefix=True, kv_prune=None, max_num_seqs=8,
                max_batched=256) -> Engine:
    """A fresh engine over ``opt``'s compiled program (graphs hold no runtime state)."""
    info = opt.info
    cache = PagedKVCache(KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, 4), num_blocks)
    runner = ModelRunner(opt.program, cache, vocab_size=info.vocab_size,
                         backend=backend or get_backend("cpu_sdpa"))
    setting = opt.optimize_config.kv_prune if kv_prune is None else KVPruneConfig.coerce(kv_prune)
    return Engine(runner, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched),
                  max_model_len=512, enable_prefix_caching=prefix, debug_checks=True, kv_prune=setting)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


CAP = dict(threshold=0.0, step_interval=2, sink_tokens=2, recent_tokens=4, max_tokens=20)


# -- identity ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu_sdpa", "torch_reference"])
def test_threshold_zero_is_identity(base, pruned, backend):
    """threshold=0 and no caps: every token scores >= 0, nothing is evicted, outputs are identical."""
    prompts = [prompt(1, 37), prompt(2, 9), prompt(3, 21)]
    want = engine_over(base, backend=get_backend(backend)).generate(
        prompts, SamplingParams(max_new_tokens=12))
    eng = engine_over(pruned, backend=get_backend(backend))
    got = eng.generate(prompts, SamplingParams(max_new_tokens=12, kv_prune={"threshold": 0.0, "step_interval": 1,
                                                                           "sink_tokens": 0, "recent_tokens": 0}))
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    stats = eng.kv_stats()
    assert stats["kv_prune_evaluations"] > 0 and stats["kv_prune_evicted_tokens"] == 0


# -- the masking reference ----------------------------------------------------------------

class MaskedReference:
    """Test backend: reference attention over an unpruned cache that hides, per layer, the
    positions in ``hidden[layer]`` (one sequence; slot == position there)."""

    name = "masked_reference"
    priority = 0

    def __init__(self, cache: PagedKVCache) -> None:
        self.layer_of = {cache.layer(i)[0].data_ptr(): i for i in range(cache.spec.num_layers)}
        self.hidden: dict[int, torch.Tensor] = {}

    def is_available(self, device) -> bool:
        return True

    def supports(self, **_) -> bool:
        return True

    def forward(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window):
        write_kv(k, v, k_cache, v_cache, meta)
        assert meta.num_seqs == 1
        layer = self.layer_of[k_cache.data_ptr()]
        L, T = meta.seq_lens_host[0], q.shape[0]
        kk = gather_sequence(k_cache, meta.block_tables[0], L).float()
        vv = gather_sequence(v_cache, meta.block_tables[0], L).float()
        Hkv, D = kk.shape[1], kk.shape[2]
        G = q.shape[1] // Hkv
        s = torch.einsum("qhgd,khd->hgqk", q.float().view(T, Hkv, G, D), kk) * scale
        visible = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
        hidden = self.hidden.get(layer)
        if hidden is not None:
            visible &= ~hidden[:L][None, :]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("hgqk,khd->qhgd", p, vv).reshape(T, q.shape[1], -1).to(q.dtype)


@pytest.mark.parametrize("backend,policy,recency", [
    ("torch_reference", "attention", 0.0), ("cpu_sdpa", "attention", 0.0), ("cpu_sdpa", "streaming", 0.0),
    ("cpu_sdpa", "random", 0.0), ("cpu_sdpa", "attention", 0.5)])
def test_logits_match_masking_reference(pruned, backend, policy, recency):
    ids = prompt(7, 41)
    n_new = 26
    cfg = dict(CAP, policy=policy, threshold=0.9 if policy == "attention" else 0.0, recency_layers=recency)
    eng = engine_over(pruned, backend=get_backend(backend), prefix=False)
    logits, kept, sinks_recent = [], [], []

    def record(tokens, row):
        logits.append(row.clone())
        seq = eng.requests["r"]
        st_ = seq.kv_prune_state
        if st_ is None:
            kept.append(None)
        else:
            pos = st_.positions[:, :st_.n].clone()
            assert pos.shape[1] == seq.num_slots
            kept.append(pos)
        return row

    eng.add_request(ids, SamplingParams(max_new_tokens=n_new, kv_prune=cfg, logits_processors=[record]),
                    request_id="r")
    while eng.has_unfinished():
        eng.step()
    seq = eng.requests["r"]
    assert seq.error is None and seq.metrics.kv_evicted_tokens > 0
    tokens = seq.output_ids

    # sinks and the recent window survive every evaluation, in every layer
    for i, pos in enumerate(kept):
        if pos is None:
            continue
        total = len(ids) + i  # positions computed when this snapshot was taken
        for layer in range(pos.shape[0]):
            have = set(pos[layer].tolist())
            assert set(range(CAP["sink_tokens"])) <= have
            assert set(range(total - CAP["recent_tokens"], total)) <= have
            assert len(have) == pos.shape[1]  # no duplicated position
        # recency layers (the first round(recency * layers)) keep the sinks and the newest tokens only
        for layer in range(round(recency * pos.shape[0])):
            live = sorted(pos[layer].tolist())
            s = CAP["sink_tokens"]
            assert live == list(range(s)) + list(range(live[-1] + 1 - (len(live) - s), live[-1] + 1))
    if recency:  # the last layer chose by score: its final kept set differs from the recency layer's
        last = [p for p in kept if p is not None][-1]
        assert sorted(last[-1].tolist()) != sorted(last[0].tolist())

    # reference: same tokens forced, evicted positions masked in place
    ref_cache_engine = engine_over(pruned, prefix=False)
    masked = MaskedReference(ref_cache_engine.runner.kv_cache)
    ref_cache_engine.runner.backend = masked
    ref_logits = []

    def force(tok_ids, row):
        i = len(ref_logits)
        ref_logits.append(row.clone())
        pos = kept[i]
        total = len(ids) + i + 1  # positions after the next token is computed
        if pos is not None:
            hidden = torch.ones((pos.shape[0], total), dtype=torch.bool)
            for layer in range(pos.shape[0]):
                hidden[layer, pos[layer]] = False
            hidden[:, total - 1] = False  # the token computed next step
            masked.hidden = dict(enumerate(hidden))
        out = torch.full_like(row, float("-inf"))
        out[tokens[i]] = 0.0
        return out

    ref_cache_engine.generate([ids], SamplingParams(max_new_tokens=n_new, kv_prune=False, logits_processors=[force]))
    assert len(ref_logits) == len(logits) == n_new
    for i, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"step {i}")


# -- pages ----------------------------------------------------------------------------------

def test_pool_free_count_rises_by_freed_pages(pruned):
    eng = engine_over(pruned, prefix=False)
    pruner = eng.pruner
    deltas = []
    original = pruner.compact

    def spy(seq, evict):
        free0, freed0, copies0 = eng.kv.allocator.num_free, seq.metrics.kv_freed_blocks, pruner.totals.copied_blocks
        blocks0 = len(seq.block_table)
        ok = original(seq, evict)
        deltas.append((eng.kv.allocator.num_free - free0, seq.metrics.kv_freed_blocks - freed0,
                       pruner.totals.copied_blocks - copies0))
        assert blocks0 - len(seq.block_table) == deltas[-1][1]  # no sharing here: every dropped block is freed
        return ok

    pruner.compact = spy
    eng.generate([prompt(11, 60)], SamplingParams(max_new_tokens=10, kv_prune=CAP))
    assert deltas and deltas[0][1] > 0  # the first evaluation frees most of the prompt's pages
    for rose, freed, copies in deltas:
        assert rose == freed - copies
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks


def test_peak_and_live_tokens_under_cap(pruned):
    eng = engine_over(pruned, prefix=False)
    out = eng.generate([prompt(12, 30)], SamplingParams(max_new_tokens=40, kv_prune=CAP))[0]
    m = out.metrics
    # live tokens never exceed the cap by more than the tokens added between evaluations
    assert m.kv_live_tokens <= CAP["max_tokens"] + CAP["step_interval"] - 1
    assert m.kv_evicted_tokens == 30 + 40 - 1 - m.kv_live_tokens
    assert m.kv_freed_blocks > 0


def test_shared_prefix_blocks_are_copied_not_edited(pruned):
    """A pruning request shares cached prompt blocks with an unpruned one: the unpruned
    request's output must not change, and no changed block stays registered."""
    shared = prompt(21, 32)
    a, b = shared + prompt(22, 5), shared + prompt(23, 7)
    want = engine_over(pruned, prefix=False).generate([b], SamplingParams(max_new_tokens=16, kv_prune=False))
    eng = engine_over(pruned)
    eng.generate([a], SamplingParams(max_new_tokens=2, kv_prune=False))  # registers the shared blocks
    rb = eng.add_request(b, SamplingParams(max_new_tokens=16, kv_prune=False))
    ra = eng.add_request(a, SamplingParams(max_new_tokens=16, kv_prune=dict(CAP, step_interval=1)))
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[ra].metrics.prefix_hit_tokens > 0 and eng.requests[ra].metrics.kv_evicted_tokens > 0
    assert eng.pruner.totals.copied_blocks > 0
    assert eng.requests[rb].output_ids == want[0].output_ids
    # the cache still serves the shared prefix correctly to a later, unpruned request
    again = eng.generate([b], SamplingParams(max_new_tokens=16, kv_prune=False))
    assert again[0].output_ids == want[0].output_ids
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 40), n_req=st.integers(1, 5),
       policy=st.sampled_from(["attention", "streaming", "random"]), interval=st.integers(1, 3),
       max_tokens=st.integers(6, 24), threshold=st.sampled_from([0.0, 0.3, 0.9]))
def test_no_block_leaks_random_workloads(pruned, seed, num_blocks, n_req, policy, interval, max_tokens, threshold):
    """Random prompts sharing prefixes, mixed pruning / not, small pools (preemption): every
    block returns to the pool, every write hits a writable block (debug_checks), and the
    prefix cache afterwards still gives unpruned requests the right K/V."""
    rng = random.Random(seed)
    stem = prompt(seed, rng.randrange(4, 20))
    prompts = [stem[:rng.randrange(1, len(stem) + 1)] + prompt(seed + i + 1, rng.randrange(1, 12))
               for i in range(n_req)]
    cfg = dict(threshold=threshold, step_interval=interval, sink_tokens=rng.randrange(0, 3),
               recent_tokens=rng.randrange(0, 4), max_tokens=max_tokens, policy=policy,
               prefill_window=rng.choice([0, 0, 4]))
    eng = engine_over(pruned, num_blocks=num_blocks, max_num_seqs=3, max_batched=rng.choice([8, 64]))
    params = [SamplingParams(max_new_tokens=rng.randrange(1, 20), kv_prune=cfg if rng.random() < 0.7 else False)
              for _ in prompts]
    outs = eng.generate(prompts, params)
    assert all(o.finished for o in outs)
    a = eng.kv.allocator
    assert a.num_free == a.num_blocks and all(r == 0 for r in a.ref_count)
    probe = prompts[0]
    want = engine_over(pruned, prefix=False).generate([probe], SamplingParams(max_new_tokens=4, kv_prune=False))
    got = eng.generate([probe], SamplingParams(max_new_tokens=4, kv_prune=False))
    assert got[0].output_ids == want[0].output_ids


# -- the pass, the API, bad input --------------------------------------------------------

def test_pass_inserts_one_node_per_layer_in_decode_only(pruned, base):
    rec = {r.name: r for r in pruned.pass_report.records}["insert_kv_prune"]
    assert rec.status == "ran" and rec.matches == 2 * pruned.info.num_layers  # decode + prefill
    target = torch.ops.devin.kv_prune.default
    count = {ph: sum(n.target is target for n in gm.graph.nodes) for ph, gm in pruned.program.graphs.items()}
    assert count == {"prefill": pruned.info.num_layers, "decode": pruned.info.num_layers}
    assert "insert_kv_prune" not in {r.name for r in base.pass_report.records}
    assert base.engine.pruner is None


def test_decorator_turns_pruning_on(model):
    with dc.enable_kv_pruning(**CAP):
        opt = dc.optimize(model, num_kv_blocks=64, block_size=4)  # compiled with the decorator's config
    assert opt.engine.pruner is not None
    ids = prompt(31, 40)

    @dc.enable_kv_pruning(threshold=0.0, step_interval=1, sink_tokens=2, recent_tokens=4, max_tokens=12)
    def run():
        return opt.engine.generate([ids], SamplingParams(max_new_tokens=6))[0]

    inside = run()
    assert inside.metrics.kv_live_tokens <= 12
    plain = dc.optimize(model, num_kv_blocks=64, block_size=4, kv_prune={"enabled": False})
    outside = plain.engine.generate([ids], SamplingParams(max_new_tokens=6))[0]
    assert outside.metrics.kv_evicted_tokens == 0
    off = opt.engine.generate([ids], SamplingParams(max_new_tokens=6, kv_prune=False))[0]
    assert off.metrics.kv_evicted_tokens == 0 and off.output_ids == outside.output_ids


@pytest.mark.parametrize("bad,field", [
    ({"threshold": 1.0}, "threshold"), ({"threshold": -0.1}, "threshold"), ({"step_interval": 0}, "step_interval"),
    ({"sink_tokens": -1}, "sink_tokens"), ({"recent_tokens": -4}, "recent_tokens"),
    ({"max_tokens": 10, "sink_tokens": 4, "recent_tokens": 64}, "max_tokens"), ({"max_ratio": 0.0}, "max_ratio"),
    ({"policy": "lru"}, "policy"), ({"policy": "streaming"}, "policy"), ({"thresold": 0.1}, "thresold"),
    ({"recency_layers": 1.5}, "recency_layers"), ({"recency_layers": -0.5}, "recency_layers"),
])
def test_bad_config_names_the_field(model, bad, field):
    with pytest.raises(ValueError, match=field):
        KVPruneConfig.coerce(bad)
    with pytest.raises(ValueError, match=field):
        SamplingParams(kv_prune=bad)
    with pytest.raises(ValueError, match=field):
        dc.optimize(model, kv_prune=bad)  # before any capture work


def test_requests_cannot_prune_without_nodes(base):
    with pytest.raises(ValueError, match="without kv_prune"):
        base.engine.add_request([5, 6, 7], SamplingParams(kv_prune={"threshold": 0.1}))
    with dc.enable_kv_pruning(threshold=0.1):
        with pytest.raises(ValueError, match="without kv_prune"):
            base.engine.add_request([5, 6, 7], SamplingParams())


def test_sliding_window_models_are_refused(tiny_model):
    with pytest.raises(PassError, match="sliding window"):
        dc.optimize(tiny_model("mistral"), num_kv_blocks=16, kv_prune={"threshold": 0.1})


def test_prefill_window_prunes_the_prompt_once(pruned):
    """SnapKV-style: the prompt's last queries score it and it is cut to the cap right after prefill."""
    eng = engine_over(pruned, prefix=False, max_batched=20)  # chunks 20, 20, 10: the window lies in the last one
    seen = []

    def record(tokens, row):
        seq = eng.requests["w"]
        seen.append((seq.num_slots, seq.kv_prune_state.obs[:, :seq.num_slots].clone()))
        return row

    cfg = dict(CAP, prefill_window=8, step_interval=4)
    eng.add_request(prompt(41, 50), SamplingParams(max_new_tokens=3, kv_prune=cfg, logits_processors=[record]),
                    request_id="w")
    while eng.has_unfinished():
        eng.step()
    slots, obs = seen[0]  # sampled right after the prefill step
    assert slots == CAP["max_tokens"]
    assert float(obs.max()) == 8 and float(obs.min()) >= 1  # every kept slot was seen by the window
    assert eng.requests["w"].metrics.kv_evicted_tokens == 50 - CAP["max_tokens"]


def test_forward_pool_spreads_scores_to_following_positions():
    from devin_compile.runtime.kv_prune import pool_by_position

    scores = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 1.0, math.inf]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6]])
    assert pool_by_position(scores, positions, 3).tolist() == [[0.0, 5.0, 5.0, 5.0, 0.0, 1.0, math.inf]]
    shuffled = torch.tensor([[4, 0, 6, 2, 1, 5, 3]])  # slot order differs from position order after compaction
    s2 = torch.tensor([[0.0, 0.0, math.inf, 0.0, 5.0, 1.0, 0.0]])  # position 1 scores 5, position 5 scores 1
    assert pool_by_position(s2, shuffled, 3).tolist() == [[0.0, 0.0, math.inf, 5.0, 5.0, 1.0, 5.0]]
