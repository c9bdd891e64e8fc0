"""Token logprobs in the engine (SamplingParams.logprobs): one entry per output token, equal to the
raw log_softmax of a full teacher-forced forward (before temperature and logits processors), the
same with speculative decoding (accepted proposals and the bonus token read from their verify
rows), streamed per step; off (None) by default; bad values are a ValueError. Also the engine's
step hooks (StepInfo)."""
from __future__ import annotations

import pytest
import torch

import devin_compile
from devin_compile.runtime.sampling import SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],  # repeats: the n-gram proposer finds matches
    [11, 12, 13, 11, 12],
    list(range(20, 47)),
]
NEW = 20
KW = dict(num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain(model):
    return devin_compile.optimize(model, **KW)


def _teacher_forced(opt, out) -> torch.Tensor:
    """log_softmax of a full forward over prompt + output: row j predicts output token j."""
    n = len(out.prompt_ids)
    logits = opt.engine.forward_logits(out.prompt_ids + out.output_ids)
    return torch.log_softmax(logits.float(), -1)[n - 1:n - 1 + len(out.output_ids)]


def _check_against_forward(opt, outs, k: int) -> None:
    for out in outs:
        assert len(out.logprobs) == len(out.output_ids)
        ref = _teacher_forced(opt, out)
        for j, (tok, lp) in enumerate(zip(out.output_ids, out.logprobs)):
            assert lp.token_id == tok
            assert abs(lp.logprob - float(ref[j, tok])) < 1e-4, (j, lp.logprob, float(ref[j, tok]))
            assert len(lp.top) == k
            top_v, top_i = ref[j].topk(k)
            assert [t for t, _ in lp.top] == top_i.tolist() or torch.allclose(
                torch.tensor([v for _, v in lp.top]), top_v, atol=1e-4)  # ties may order differently
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def test_logprobs_equal_teacher_forced_log_softmax(plain):
    outs = plain.engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=3))
    _check_against_forward(plain, outs, 3)
    assert outs[0].logprobs[0].top[0][0] == outs[0].output_ids[0]  # greedy: the chosen token is the top one


def test_raw_distribution_before_temperature_and_processors(plain):
    """Sampled at temperature 0.5 with a processor that bans a token: the logprobs are still the model's."""
    banned = 7

    def ban(ids, logits):
        logits[banned] = float("-inf")
        return logits

    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, do_sample=True, temperature=0.5, seed=3,
                            logits_processors=[ban], logprobs=2)
    outs = plain.engine.generate(PROMPTS, params)
    assert all(banned not in o.output_ids for o in outs)
    _check_against_forward(plain, outs, 2)


def test_off_by_default_and_zero_alternatives(plain):
    out = plain.engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=4))[0]
    assert out.logprobs is None and out.new_logprobs is None
    out = plain.engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=0))[0]
    assert len(out.logprobs) == 4 and all(lp.top == [] for lp in out.logprobs)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_bad_logprobs_is_a_value_error(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_tokens": 4}, "same-model"])
def test_speculative_logprobs_match_plain_decoding(model, plain, spec):
    """Greedy with speculation: same tokens, and logprobs within 1e-4 of the plain run's, one per
    token (a draft equal to the target has every proposal accepted: rows beyond the first matter)."""
    if spec == "same-model":
        spec = {"method": "draft", "model": model, "num_tokens": 3}
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=4)
    ref = plain.engine.generate(PROMPTS, params)
    opt = devin_compile.optimize(model, speculative=spec, **KW)
    outs = opt.engine.generate(PROMPTS, params)
    assert opt.engine.spec_stats()["accepted"] > 0
    for a, b in zip(ref, outs):
        assert a.output_ids == b.output_ids
        assert len(b.logprobs) == len(b.output_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert max(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)) < 1e-4


def test_sampled_speculation_logprobs_follow_their_tokens(model):
    opt = devin_compile.optimize(model, speculative={"method": "draft", "model": model, "num_tokens": 3}, **KW)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, do_sample=True, temperature=0.8, seed=5, logprobs=1)
    outs = opt.engine.generate(PROMPTS, params)
    assert opt.engine.spec_stats()["accepted"] > 0
    _check_against_forward(opt, outs, 1)


def test_streamed_new_logprobs_concatenate_to_the_full_list(plain):
    eng = plain.engine
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=1))
    got, last = [], None
    while not eng.requests[rid].status.done:
        for out in eng.step():
            if out.request_id == rid:
                assert len(out.new_logprobs) == len(out.new_ids)
                got += out.new_logprobs
                last = out
    assert [lp.token_id for lp in got] == last.output_ids and got == last.logprobs


def test_step_hooks_see_every_step(model):
    opt = devin_compile.optimize(model, speculative={"method": "draft", "model": model, "num_tokens": 3}, **KW)
    eng = opt.engine
    assert eng.step_hooks == []
    seen = []
    eng.add_step_hook(seen.append)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [s.index for s in seen] == list(range(1, eng.metrics.steps + 1))
    first = seen[0]
    assert first.batch_size == 3 and first.prefill_tokens == sum(map(len, PROMPTS)) and first.decode_tokens == 0
    assert sum(s.drafted_tokens for s in seen) == eng.spec_stats()["drafted"]
    assert sum(s.accepted_tokens for s in seen) == eng.spec_stats()["accepted"]
    assert all(s.start <= s.end for s in seen)
    decode = [s for s in seen if s.decode_tokens]
    assert decode and all(sum(s.request_tokens) == s.decode_tokens + s.drafted_tokens for s in decode)
    assert sum(len(o.output_ids) for o in outs) == 3 * NEW


def test_a_raising_step_hook_is_dropped_and_requests_go_on(plain):
    def broken(info):
        raise RuntimeError("boom")

    eng = plain.engine
    eng.add_step_hook(broken)
    try:
        out = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
        assert len(out.output_ids) == 4 and out.error is None
        assert broken not in eng.step_hooks
    finally:
        eng.step_hooks.clear()
