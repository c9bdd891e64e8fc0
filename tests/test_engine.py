"""Engine and OptimizedModel behaviour against Hugging Face greedy decoding (fp32).

One tiny Llama is optimized per module; engines with other pool sizes / scheduler limits
are built over the same compiled program (graphs hold no runtime state). The HF oracle is
a plain greedy loop over the full sequence (no HF KV cache), run once per prompt.
"""
from __future__ import annotations

import random

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import devin_compile as dc
from devin_compile.config import SchedulerConfig
from devin_compile.runtime.engine import Engine, RequestError
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
from devin_compile.runtime.model_runner import ModelRunner
from devin_compile.runtime.sampling import SamplingParams
from devin_compile.runtime.sequence import Status

VOCAB = 256
EOS = 2


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=EOS)
    return LlamaForCausalLM(cfg).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the model's 256 ids, built offline."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")



@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def opt(model, tokenizer):
    return dc.optimize(model, tokenizer=tokenizer, num_kv_blocks=128, block_size=4)


_HF_CACHE: dict = {}


@pytest.fixture(scope="module")
def hf(model):
    """hf(prompt, n) → HF's greedy n new tokens (ignoring EOS), memoised."""

    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in _HF_CACHE:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                for _ in range(n):
                    nxt = model(ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            _HF_CACHE[key] = ids[0, len(prompt):].tolist()
        return _HF_CACHE[key]

    return run


def make_engine(opt, num_blocks: int, block_size: int = 4, **sched) -> Engine:
    info = opt.info
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, block_size)
    runner = ModelRunner(opt.program, PagedKVCache(spec, num_blocks, info.device), vocab_size=info.vocab_size,
                         backend=opt.engine.runner.backend, device=info.device)
    return Engine(runner, SchedulerConfig(**sched), max_model_len=info.max_model_len,
                  eos_token_ids=info.eos_token_ids)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(length)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def assert_pool_empty(engine: Engine) -> None:
    assert engine.kv_stats()["blocks_used"] == 0
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks
    assert all(c == 0 for c in engine.kv.allocator.ref_count)
    assert not engine.has_unfinished()


# ----------------------------------------------------------------------------------------
# Greedy equality with HF


def test_mixed_lengths_together_match_hf(opt, hf):
    engine = make_engine(opt, 64)
    lengths = [1, 3, 7, 12, 17]
    news = [6, 1, 9, 4, 7]
    prompts = [prompt_of(n, seed=i) for i, n in enumerate(lengths)]
    results = engine.generate(prompts, [greedy(n) for n in news])
    for p, n, r in zip(prompts, news, results):
        assert r.finished and r.finish_reason == "length" and r.error is None
        assert r.prompt_ids == p
        assert r.output_ids == hf(p, n), f"prompt of length {len(p)}"
    assert_pool_empty(engine)


def test_chunked_prefill_matches_hf(opt, hf):
    engine = make_engine(opt, 64, max_num_batched_tokens=8)
    planned: list[int] = []
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        planned.append(plan.num_tokens)
        return plan

    engine.scheduler.schedule = spy
    prompts = [prompt_of(n, seed=10 + n) for n in (5, 13, 21)]
    results = engine.generate(prompts, greedy(6))
    assert max(planned) <= 8
    assert engine.metrics.prefill_tokens >= sum(len(p) for p in prompts)
    for p, r in zip(prompts, results):
        assert r.output_ids == hf(p, 6)
    assert_pool_empty(engine)


def test_preemption_with_recompute_matches_hf(opt, hf):
    # 8 blocks of 4 = 32 slots; each request needs up to 6 + 14 = 20, so at most one fits to the end.
    engine = make_engine(opt, 8)
    prompts = [prompt_of(6, seed=20 + i) for i in range(4)]
    results = engine.generate(prompts, greedy(14))
    assert engine.metrics.preemptions > 0
    assert sum(r.metrics.preemptions for r in results) == engine.metrics.preemptions
    for p, r in zip(prompts, results):
        assert r.finished and r.error is None
        assert r.output_ids == hf(p, 14)
    assert_pool_empty(engine)


def test_step_and_stream_apis(opt, hf):
    engine = make_engine(opt, 64)
    pa, pb = prompt_of(5, 30), prompt_of(9, 31)
    ra = engine.add_request(pa, greedy(6))
    rb = engine.add_request(pb, greedy(8), request_id="mine")
    assert rb == "mine"
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(pb, greedy(2), request_id="mine")
    streamed: dict[str, list[int]] = {ra: [], rb: []}
    outs = engine.step()  # both prefill at once
    assert {o.request_id for o in outs} == {ra, rb}
    for o in outs:
        streamed[o.request_id] += o.new_ids
    assert list(engine.stream(ra)) == hf(pa, 6)  # stream drives steps (and b progresses too)
    assert engine.requests[ra].status is Status.FINISHED
    seen_b = len(engine.requests[rb].output_ids)
    assert seen_b == 6  # b decoded in the same steps
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rb
            streamed[rb] += o.new_ids
    assert engine.requests[rb].output_ids == hf(pb, 8)
    assert streamed[rb] == hf(pb, 8)[:1] + hf(pb, 8)[seen_b:]
    assert engine.step() == []  # nothing left to do
    assert_pool_empty(engine)


def test_abort_neighbour_midway(opt, hf):
    engine = make_engine(opt, 64)
    prompts = [prompt_of(n, seed=40 + n) for n in (4, 10, 6)]
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    for _ in range(3):
        engine.step()
    victim = engine.requests[ids[1]]
    held = len(victim.block_table)
    assert held > 0
    free_before = engine.kv.allocator.num_free
    engine.abort(ids[1])
    assert engine.kv.allocator.num_free == free_before + held  # blocks back at once
    assert victim.block_table == [] and victim.status is Status.ABORTED and victim.finish_reason == "abort"
    engine.abort(ids[1])  # aborting twice is a no-op
    engine.abort("no-such-request")
    while engine.has_unfinished():
        engine.step()
    assert len(victim.output_ids) < 10
    for i in (0, 2):
        assert engine.requests[ids[i]].output_ids == hf(prompts[i], 10)
    assert list(engine.stream(ids[1])) == victim.output_ids  # a done request streams what it had
    assert_pool_empty(engine)


# ----------------------------------------------------------------------------------------
# Stopping


def _force_after(prompt_len: int, k: int, token: int):
    def proc(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(ids) >= prompt_len + k:
            logits = torch.full_like(logits, float("-inf"))
            logits[token] = 0.0
        return logits
    return proc


def test_eos_stops_unless_ignored(opt, hf):
    engine = make_engine(opt, 64)
    p = prompt_of(5, 50)
    force = _force_after(len(p), 3, EOS)
    stop, ignore = engine.generate([p, p], [SamplingParams(max_new_tokens=10, logits_processors=[force]),
                                            SamplingParams(max_new_tokens=10, logits_processors=[force],
                                                           ignore_eos=True)])
    assert stop.output_ids == hf(p, 3) + [EOS] and stop.finish_reason == "stop"
    assert ignore.output_ids == hf(p, 3) + [EOS] * 7 and ignore.finish_reason == "length"
    assert_pool_empty(engine)


def test_stop_token_ids(opt, hf):
    engine = make_engine(opt, 64)
    p = prompt_of(7, 51)
    ref = hf(p, 12)
    stop_tok = ref[4]
    (r,) = engine.generate([p], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_tok]))
    assert r.output_ids == ref[: ref.index(stop_tok) + 1] and r.finish_reason == "stop"


# ----------------------------------------------------------------------------------------
# Sampling


def _sample(engine: Engine, prompt: list[int], seed: int | None, **kw) -> list[int]:
    (r,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, do_sample=True, seed=seed,
                                                    ignore_eos=True, **kw))
    return r.output_ids


def test_seeded_sampling_is_reproducible(opt):
    engine = make_engine(opt, 64)
    p = prompt_of(6, 60)
    a = _sample(engine, p, 123, temperature=1.5)
    assert _sample(engine, p, 123, temperature=1.5) == a
    others = [_sample(engine, p, s, temperature=1.5) for s in (1, 2, 3)]
    assert any(o != a for o in others)
    # a seeded request samples the same tokens when batched with others
    mixed = engine.generate([prompt_of(3, 61), p, prompt_of(11, 62)],
                            [greedy(5), SamplingParams(max_new_tokens=12, do_sample=True, seed=123, temperature=1.5,
                                                       ignore_eos=True), greedy(9)])
    assert mixed[1].output_ids == a
    assert_pool_empty(engine)


def test_top_k_one_equals_greedy(opt, hf):
    engine = make_engine(opt, 64)
    p = prompt_of(8, 63)
    assert _sample(engine, p, 7, top_k=1, temperature=0.7) == hf(p, 12)
    assert _sample(engine, p, None, top_p=1e-6) == hf(p, 12)  # a tiny nucleus keeps only the argmax


def test_raising_logits_processor_fails_only_its_request(opt, hf):
    engine = make_engine(opt, 64)

    def boom(ids, logits):
        if len(ids) > 8:
            raise KeyError("boom")
        return logits

    prompts = [prompt_of(4, 70), prompt_of(6, 71), prompt_of(5, 72)]
    results = engine.generate(prompts, [greedy(6), greedy(6, logits_processors=[boom]), greedy(6)])
    bad = results[1]
    assert engine.requests[bad.request_id].status is Status.FAILED
    assert bad.finish_reason == "error" and "logits processor raised KeyError" in bad.error
    assert len(bad.output_ids) == 8 - 6 + 1  # tokens sampled before the processor raised
    for i in (0, 2):
        assert results[i].error is None and results[i].output_ids == hf(prompts[i], 6)
    with pytest.raises(RequestError, match="boom"):
        list(engine.stream(bad.request_id))
    assert_pool_empty(engine)


# ----------------------------------------------------------------------------------------
# Property: random add / abort / step traffic on a small random pool


def _check_pool(engine: Engine) -> None:
    alloc = engine.kv.allocator
    live = [s for s in engine.requests.values() if not s.status.done]
    held = Counter(b for s in live for b in s.block_table)  # prefix sharing may give a block several owners
    assert alloc.num_free + len(held) == alloc.num_blocks, "block leak"
    assert all(c >= 0 for c in alloc.ref_count)
    assert all(alloc.ref_count[b] == n for b, n in held.items()), "reference count != number of owners"
    assert sorted(alloc._free) == sorted(set(range(alloc.num_blocks)) - set(held))
    assert len(engine.scheduler.running) <= engine.config.max_num_seqs
    bs = engine.runner.block_size
    for s in live:
        assert len(s.block_table) * bs >= s.num_computed  # every cached token has a slot
    for s in engine.requests.values():
        if s.status.done:
            assert s.block_table == []


# (kind, a, b): kind 0-2 add a prompt of a tokens with b new tokens, 3-4 step, 5 abort request #a
_op = st.tuples(st.integers(0, 5), st.integers(1, 14), st.integers(1, 12))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(2, 12), block_size=st.sampled_from([2, 4, 8]), max_num_seqs=st.integers(1, 4),
       max_batched=st.sampled_from([3, 8, 64]), ops=st.lists(_op, min_size=3, max_size=40),
       seed=st.integers(0, 2**16))
def test_random_traffic_keeps_pool_consistent(opt, num_blocks, block_size, max_num_seqs, max_batched, ops, seed):
    engine = make_engine(opt, num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched)
    pool = num_blocks * block_size
    added: list[str] = []
    for i, (kind, a, b) in enumerate(ops):
        if kind <= 2:
            plen, new = a, b
            params = SamplingParams(max_new_tokens=new, do_sample=bool(i % 2), seed=seed + i)
            if plen + new > pool:
                with pytest.raises(ValueError, match="KV pool"):
                    engine.add_request(prompt_of(plen, seed + i), params)
            else:
                added.append(engine.add_request(prompt_of(plen, seed + i), params))
        elif kind == 5 and added:
            engine.abort(added[a % len(added)])
        elif kind in (3, 4):
            engine.step()
        _check_pool(engine)
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        engine.step()
        _check_pool(engine)
    for rid in added:
        seq = engine.requests[rid]
        assert seq.status in (Status.FINISHED, Status.ABORTED, Status.FAILED), (rid, seq.status)
        assert seq.status is not Status.FAILED, seq.error  # every admitted request fits the pool alone
        assert len(seq.output_ids) <= seq.params.max_new_tokens
        if seq.finish_reason == "length":
            assert len(seq.output_ids) == seq.params.max_new_tokens
    assert_pool_empty(engine)


# ----------------------------------------------------------------------------------------
# OptimizedModel.generate / __call__


def test_generate_token_lists(opt, hf):
    prompts = [prompt_of(3, 80), prompt_of(9, 81)]
    outs = opt.generate(prompts, max_new_tokens=[5, 7], ignore_eos=True)
    assert outs == [hf(prompts[0], 5), hf(prompts[1], 7)]
    assert_pool_empty(opt.engine)


def test_generate_strings(opt, hf, tokenizer):
    texts = ["w10 w11 w12", "w200 w7 w99 w42 w5"]
    outs = opt.generate(texts, max_new_tokens=6, ignore_eos=True)
    for text, out in zip(texts, outs):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert out == tokenizer.decode(hf(ids, 6), skip_special_tokens=True)
    single = opt.generate(texts[0], max_new_tokens=6, ignore_eos=True)
    assert single == outs[0]


def test_generate_tensor_form_like_hf(opt, hf, model):
    a, b = prompt_of(6, 90), prompt_of(3, 91)
    pad = 0
    input_ids = torch.tensor([a, [pad] * 3 + b])  # left padding, as HF batches prompts
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    out = opt.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=5, ignore_eos=True)
    assert out.shape == (2, 6 + 5) and out.dtype == input_ids.dtype
    assert torch.equal(out[:, :6], input_ids)
    assert out[0, 6:].tolist() == hf(a, 5) and out[1, 6:].tolist() == hf(b, 5)
    ref = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None,
                         pad_token_id=pad)
    assert torch.equal(out, ref)
    # rows that stop early are right-padded with the pad id (here EOS, the config has no pad id)
    force = _force_after(6, 1, EOS)
    out2 = opt.generate(input_ids=input_ids, attention_mask=mask,
                        params=[SamplingParams(max_new_tokens=5, logits_processors=[force]), greedy(5)])
    assert out2.shape == (2, 11)
    assert out2[0].tolist() == a + hf(a, 1) + [EOS] + [EOS] * 3
    assert out2[1, 6:].tolist() == hf(b, 5)
    # like HF, the width is the longest row's: a batch that all stops early is narrower
    out3 = opt.generate(input_ids=input_ids[:1], max_new_tokens=5, logits_processors=[force])
    assert out3[0].tolist() == a + hf(a, 1) + [EOS]
    assert_pool_empty(opt.engine)


def test_call_logits_equal_hf(opt, model):
    ids = torch.tensor([prompt_of(11, 95), prompt_of(11, 96)])
    with torch.no_grad():
        ref = model(ids).logits
    got = opt(ids).logits
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # with padding: padded positions are 0, real ones equal the unpadded row's logits
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    got = opt(ids, attention_mask=mask).logits
    with torch.no_grad():
        row = model(ids[1:, 4:]).logits[0]
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, 4:], row, atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(got[1, :4]) == 0
    assert_pool_empty(opt.engine)


def test_engine_takes_the_resolved_kv_prune_setting(opt):
    """optimize() resolves KV pruning once and hands the engine a KVPruneConfig or None; the
    engine neither coerces nor looks at graphs."""
    with pytest.raises(TypeError, match="KVPruneConfig or None"):
        Engine(opt.engine.runner, SchedulerConfig(), max_model_len=64, kv_prune={"threshold": 0.1})
    assert opt.engine.kv_prune is None and opt.engine.pruner is None


def test_engine_generate_raise_on_error_carries_every_result(opt, hf):
    engine = make_engine(opt, 64)

    def boom(ids, logits):
        raise KeyError("boom")

    prompts = [prompt_of(4, 80), prompt_of(5, 81)]
    with pytest.raises(RequestError, match="boom") as ei:
        engine.generate(prompts, [greedy(3), greedy(3, logits_processors=[boom])], raise_on_error=True)
    ok, bad = ei.value.results
    assert ok.error is None and ok.output_ids == hf(prompts[0], 3)
    assert bad.error and ei.value.request_id == bad.request_id
    with pytest.raises(ValueError, match=r"prompt 1: empty prompt"):
        engine.generate([prompts[0], []], greedy(2))
    assert_pool_empty(engine)
