"""Prompt logprobs (SamplingParams.prompt_logprobs) in the engine: None for the first prompt token, then
each prompt token's log_softmax under HF eager's teacher-forced logits (fp32, within 1e-4) with its rank
and top-k; the same whether the prompt runs in one step or in chunks, after a prefix-cache hit was
possible, after a preemption, batched with requests that do not ask, with speculative decoding and with
KV pruning compiled in; ``max_new_tokens=0`` scores the prompt alone; bad values are a ValueError."""
from __future__ import annotations

import random

import pytest
import torch

import devin_compile
from devin_compile.config import SchedulerConfig
from devin_compile.runtime.engine import Engine
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
from devin_compile.runtime.model_runner import ModelRunner
from devin_compile.runtime.sampling import SamplingParams

FAMILY = "llama"
K = 3


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


PROMPTS = [prompt_of(n, 10 + n) for n in (27, 9, 1, 16)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(FAMILY)


@pytest.fixture(scope="module")
def opt(model):
    return devin_compile.optimize(model, num_kv_blocks=96, block_size=4)


def engine_over(opt, *, num_blocks: int = 96, prefix: bool = True, kv_prune=None, **sched) -> Engine:
    """A fresh engine over ``opt``'s compiled program (its graphs hold no runtime state)."""
    info = opt.info
    cache = PagedKVCache(KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, 4), num_blocks)
    runner = ModelRunner(opt.program, cache, vocab_size=info.vocab_size, backend=opt.engine.runner.backend)
    return Engine(runner, SchedulerConfig(**sched), max_model_len=512, enable_prefix_caching=prefix,
                  debug_checks=True, kv_prune=kv_prune)


def check_prompt(hf_reference, ids: list[int], got: list, k: int = K) -> None:
    """``got`` (RequestOutput.prompt_logprobs) against HF eager's teacher-forced log_softmax."""
    assert len(got) == len(ids) and got[0] is None
    ref = torch.log_softmax(hf_reference.logits(FAMILY, ids).float(), -1)
    for p in range(1, len(ids)):
        e, row = got[p], ref[p - 1]
        assert e.token_id == ids[p]
        assert abs(e.logprob - float(row[ids[p]])) < 1e-4, (p, e.logprob, float(row[ids[p]]))
        assert e.rank == int((row > row[ids[p]] + 1e-4).sum()) + 1 or abs(
            float(row.sort(descending=True).values[e.rank - 1]) - e.logprob) < 1e-4
        top_v, top_i = row.topk(k)
        assert len(e.top) == k
        assert [v for _, v in e.top] == pytest.approx(top_v.tolist(), abs=1e-4)
        assert [t for t, _ in e.top] == top_i.tolist() or len(set(top_v.tolist())) < k  # ties may reorder


def scoring(k: int = K, n: int = 4) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, prompt_logprobs=k)


def test_prompt_logprobs_equal_hf_teacher_forced(opt, hf_reference):
    outs = opt.engine.generate(PROMPTS, scoring())
    for ids, out in zip(PROMPTS, outs):
        check_prompt(hf_reference, ids, out.prompt_logprobs)
        assert out.output_ids == hf_reference.greedy(FAMILY, ids, 4)  # generation itself unchanged
        assert out.logprobs is None


@pytest.mark.parametrize("budget", [5, 8, 13])
def test_chunked_prefill_gives_the_same_prompt_logprobs(opt, hf_reference, budget):
    eng = engine_over(opt, max_num_batched_tokens=budget)
    steps = []
    eng.add_step_hook(steps.append)
    outs = eng.generate(PROMPTS, scoring())
    assert any(s.prefill_tokens and s.batch_size == 1 and s.prefill_tokens == budget for s in steps)  # it chunked
    for ids, out in zip(PROMPTS, outs):
        check_prompt(hf_reference, ids, out.prompt_logprobs)
    one_step = opt.engine.generate(PROMPTS, scoring())
    for a, b in zip(outs, one_step):
        assert [e and e.logprob for e in a.prompt_logprobs] == pytest.approx(
            [e and e.logprob for e in b.prompt_logprobs], abs=1e-5)


def test_cached_prefix_is_recomputed_for_a_scoring_request(opt, hf_reference):
    eng = engine_over(opt)
    shared = PROMPTS[0][:20]
    eng.generate([shared + [7, 8, 9]], SamplingParams(max_new_tokens=2))  # registers the prefix blocks
    rid = eng.add_request(shared + [11, 12], scoring())
    while eng.has_unfinished():
        eng.step()
    seq = eng.requests[rid]
    assert seq.metrics.prefix_hit_tokens == 0  # no hit: the positions' logits are needed
    check_prompt(hf_reference, shared + [11, 12], eng.outputs.output(seq, []).prompt_logprobs)
    # the scoring request's blocks were still registered: a plain request after it hits them
    rid = eng.add_request(shared + [11, 12, 13], SamplingParams(max_new_tokens=2))
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[rid].metrics.prefix_hit_tokens == 20


def test_batched_with_requests_that_do_not_ask(opt, hf_reference):
    plain = SamplingParams(max_new_tokens=6, ignore_eos=True)
    params = [scoring(), plain, scoring(0), plain]
    outs = opt.engine.generate(PROMPTS, params)
    ref = opt.engine.generate(PROMPTS, plain)
    for i, (ids, out) in enumerate(zip(PROMPTS, outs)):
        if params[i] is plain:
            assert out.prompt_logprobs is None and out.output_ids == ref[i].output_ids
        else:
            check_prompt(hf_reference, ids, out.prompt_logprobs, params[i].prompt_logprobs)


def test_preempted_request_scores_each_token_once(opt, hf_reference):
    """A pool too small for all at once: requests are preempted and recomputed (prefix hits allowed again
    once the prompt is scored) and the prompt logprobs come out once each, unchanged."""
    eng = engine_over(opt, num_blocks=16, max_num_batched_tokens=8)
    prompts = [prompt_of(14, 40 + i) for i in range(4)]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=14, ignore_eos=True, prompt_logprobs=1))
    assert eng.metrics.preemptions > 0
    for ids, out in zip(prompts, outs):
        check_prompt(hf_reference, ids, out.prompt_logprobs, 1)
        assert out.output_ids == hf_reference.greedy(FAMILY, ids, 14)


def test_zero_new_tokens_scores_the_prompt_alone(opt, hf_reference):
    outs = opt.engine.generate(PROMPTS, SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    for ids, out in zip(PROMPTS, outs):
        assert out.output_ids == [] and out.finished and out.finish_reason == "length" and out.error is None
        check_prompt(hf_reference, ids, out.prompt_logprobs, 0)
    assert opt.engine.kv.allocator.num_used == 0
    # the offline API too: generate() with such params returns no new tokens
    assert opt.generate([PROMPTS[1]], params=[SamplingParams(max_new_tokens=0, prompt_logprobs=0)]) == [[]]


def test_streamed_outputs_carry_the_whole_prompt_from_the_first(opt):
    eng = engine_over(opt, max_num_batched_tokens=8)
    rid = eng.add_request(PROMPTS[0], scoring(1, 3))
    seen = []
    while eng.has_unfinished():
        seen += [o for o in eng.step() if o.request_id == rid]
    assert len(seen) == 3 and all(len(o.prompt_logprobs) == len(PROMPTS[0]) for o in seen)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_tokens": 3}, "same-model"])
def test_with_speculative_decoding(model, hf_reference, spec):
    if spec == "same-model":
        spec = {"method": "draft", "model": model, "num_tokens": 3}
    opt = devin_compile.optimize(model, speculative=spec, num_kv_blocks=96, block_size=4)
    prompts = [PROMPTS[0] + PROMPTS[0][:12], PROMPTS[3]]  # the repeat gives the n-gram proposer matches
    outs = opt.engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=K,
                                                       logprobs=1))
    assert opt.engine.spec_stats()["accepted"] > 0
    for ids, out in zip(prompts, outs):
        check_prompt(hf_reference, ids, out.prompt_logprobs)
        assert out.output_ids == hf_reference.greedy(FAMILY, ids, 12)
    zero = opt.engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=0, prompt_logprobs=K))[0]
    check_prompt(hf_reference, PROMPTS[1], zero.prompt_logprobs)


def test_with_kv_pruning(model, hf_reference):
    """The prompt is scored in its prefill, before any eviction: the logprobs are the unpruned model's."""
    opt = devin_compile.optimize(model, num_kv_blocks=96, block_size=4,
                                 kv_prune={"threshold": 0.0, "step_interval": 1, "sink_tokens": 2,
                                           "recent_tokens": 4, "max_tokens": 8, "prefill_window": 4})
    outs = opt.engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, ignore_eos=True, prompt_logprobs=2))
    assert opt.engine.kv_stats()["kv_prune_evicted_tokens"] > 0
    for ids, out in zip(PROMPTS, outs):
        check_prompt(hf_reference, ids, out.prompt_logprobs, 2)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_bad_prompt_logprobs_is_a_value_error(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_zero_new_tokens_needs_prompt_logprobs(opt):
    with pytest.raises(ValueError, match=r"max_new_tokens=0 must be a positive integer \(0 only with prompt_logprobs"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=0).max_new_tokens == 0
