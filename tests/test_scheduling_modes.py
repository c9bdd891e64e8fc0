"""Separate vs mixed steps, dynamic batching (min_batch_size / max_wait_ms), and AsyncEngine."""
from __future__ import annotations

import asyncio

import pytest

from devin_compile import AsyncEngine
from devin_compile.config import SchedulerConfig
from devin_compile.runtime.engine import RequestError
from test_engine import assert_pool_empty, greedy, hf, make_engine, model, opt, prompt_of, tokenizer  # noqa: F401


def _record_steps(engine):
    """Wrap the runner so every step's (query lengths) is recorded."""
    steps: list[list[int]] = []
    real = engine.runner.execute

    def execute(batch, *a, **k):
        steps.append([item.num_tokens for item in batch])
        return real(batch, *a, **k)

    engine.runner.execute = execute
    return steps


@pytest.mark.parametrize("mode", ["mixed", "separate"])
def test_step_modes_match_hf(opt, hf, mode):  # noqa: F811
    engine = make_engine(opt, 96, step_mode=mode, max_num_batched_tokens=16)
    steps = _record_steps(engine)
    prompts = [prompt_of(n, 300 + i) for i, n in enumerate([9, 3, 21, 5, 14])]
    news = [7, 9, 3, 6, 5]
    # staggered arrivals: two now, the rest after a few steps, so prefills meet running decodes
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts[:2], news[:2])]
    for _ in range(3):
        engine.step()
    ids += [engine.add_request(p, greedy(n)) for p, n in zip(prompts[2:], news[2:])]
    while engine.has_unfinished():
        engine.step()
    assert [engine.requests[r].output_ids for r in ids] == [hf(p, n) for p, n in zip(prompts, news)]
    mixed_steps = [s for s in steps if 1 in s and any(n > 1 for n in s)]
    if mode == "separate":
        assert not mixed_steps, f"separate mode ran mixed steps: {mixed_steps}"
    else:
        assert mixed_steps, "mixed mode never put a prefill chunk next to decodes"
    assert_pool_empty(engine)


def test_separate_mode_decodes_when_no_prompt_can_be_admitted(opt, hf):  # noqa: F811
    """A waiting request that does not fit yet must not stall the decodes that would free room."""
    engine = make_engine(opt, 6, step_mode="separate")  # 6 blocks x 4 slots
    a, b = prompt_of(12, 1), prompt_of(16, 2)
    ra = engine.add_request(a, greedy(8))  # 3 blocks after prefill, 5 at the end
    engine.step()
    rb = engine.add_request(b, greedy(4))  # its prompt needs 4 blocks: cannot join while a runs
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "separate mode stalled behind a request that cannot be admitted"
    assert engine.requests[ra].output_ids == hf(a, 8)
    assert engine.requests[rb].output_ids == hf(b, 4)


def test_dynamic_batching_admission_rule(opt):
    engine = make_engine(opt, 64, min_batch_size=3, max_wait_ms=200.0)
    sched = engine.scheduler
    r1 = engine.add_request(prompt_of(5, 1), greedy(2))
    t0 = engine.requests[r1].metrics.arrival
    assert not sched.admission_open(now=t0 + 0.1)
    assert sched.admission_open(now=t0 + 0.25)  # the oldest waited max_wait_ms
    engine.add_request(prompt_of(5, 2), greedy(2))
    assert not sched.admission_open(now=t0 + 0.1)
    engine.add_request(prompt_of(5, 3), greedy(2))
    assert sched.admission_open(now=t0 + 0.0)  # min_batch_size reached
    plan = sched.schedule()
    assert len(plan.scheduled) == 3  # flushed together


def test_dynamic_batching_holds_then_flushes(opt, hf):  # noqa: F811
    engine = make_engine(opt, 64, min_batch_size=4, max_wait_ms=30.0)
    p = prompt_of(6, 9)
    rid = engine.add_request(p, greedy(3))
    assert engine.step() == [] and not engine.scheduler.running  # held back: 1 < min_batch_size
    out = engine.generate([prompt_of(4, 10)], greedy(2))  # drives steps until the deadline flushes both
    assert out[0].output_ids == hf(prompt_of(4, 10), 2)
    while engine.has_unfinished():
        if not engine.step():
            engine.wait_for_admission()
    seq = engine.requests[rid]
    assert seq.output_ids == hf(p, 3)
    assert seq.metrics.first_scheduled - seq.metrics.arrival >= 0.03 - 1e-3  # waited out max_wait_ms


@pytest.mark.parametrize("bad", [dict(step_mode="fast"), dict(min_batch_size=0), dict(max_wait_ms=-1)])
def test_bad_scheduler_options(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(**bad)


# ------------------------------------------------------------------------ AsyncEngine


def test_async_concurrent_requests_match_hf(opt, hf):  # noqa: F811
    engine = make_engine(opt, 96)
    prompts = [prompt_of(n, 400 + i) for i, n in enumerate([4, 11, 2, 17, 8])]
    news = [5, 3, 8, 2, 6]

    async def main():
        async with AsyncEngine(engine) as aeng:
            async def one(p, n, delay):
                await asyncio.sleep(delay)  # staggered arrivals join the running batch
                return await aeng.generate(p, greedy(n))

            async def streamed(p, n):
                return [t async for t in aeng.stream(p, greedy(n))]

            outs = await asyncio.gather(*(one(p, n, 0.002 * i) for i, (p, n) in enumerate(zip(prompts, news))),
                                        streamed(prompts[0], news[0]))
            return outs

    outs = asyncio.run(main())
    assert [o.output_ids for o in outs[:-1]] == [hf(p, n) for p, n in zip(prompts, news)]
    assert outs[-1] == hf(prompts[0], news[0])
    assert_pool_empty(engine)


def test_async_bad_request_and_cancellation_leave_others_running(opt, hf):  # noqa: F811
    engine = make_engine(opt, 96)
    p = prompt_of(7, 77)

    async def main():
        async with AsyncEngine(engine) as aeng:
            with pytest.raises(ValueError, match="empty prompt"):
                await aeng.generate([], greedy(3))
            started = asyncio.Event()

            async def long_request():
                async for _ in aeng.stream(prompt_of(9, 78), greedy(240)):  # 249 of 256 positions
                    started.set()

            long_task = asyncio.create_task(long_request())
            good = asyncio.create_task(aeng.generate(p, greedy(6)))
            await asyncio.wait_for(started.wait(), 60)  # cancel mid-generation (a fixed sleep raced fast machines)
            long_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long_task

            def boom(ids, logits):
                raise RuntimeError("processor bug")

            with pytest.raises(RequestError, match="processor bug"):
                await aeng.generate(prompt_of(3, 79), greedy(4, logits_processors=[boom]))
            out = await good
            await asyncio.sleep(0.05)  # let the step thread process the abort
            return out

    out = asyncio.run(main())
    assert out.output_ids == hf(p, 6)
    assert_pool_empty(engine)


def test_memory_accounting(opt):
    engine = make_engine(opt, 64)
    engine.generate([prompt_of(n, 500 + n) for n in (5, 9, 14, 3)], greedy(7))
    st = engine.kv_stats()
    info = opt.info
    assert st["bytes_per_token"] == 2 * info.num_layers * info.num_kv_heads * info.head_dim * 4  # fp32 K and V
    assert st["pool_bytes"] == 64 * 4 * st["bytes_per_token"]
    # blocks of 4 slots: a sequence wastes at most 3 slots, so the mean live fraction is high but < 1
    assert 0.5 < st["mean_live_slot_fraction"] < 1.0
    assert engine.metrics.allocated_slots_sampled > 0


def test_attention_padding_waste_is_reported_and_bounded(opt):
    engine = make_engine(opt, 128)
    engine.generate([prompt_of(n, 700 + n) for n in (3, 40, 5, 90, 60)], greedy(4))
    runner = engine.runner
    assert runner.attention_padded_keys >= runner.attention_real_keys > 0
    waste = engine.kv_stats()["attention_padding_waste"]
    one_rectangle = 1 - (3 + 40 + 5 + 90 + 60) / (5 * 90)  # what a single padded batch would waste at the start
    assert 0.0 <= waste < one_rectangle


def test_async_engine_after_a_failed_step_refuses_new_requests_at_once(opt):  # noqa: F811
    """A step that raises fails every waiting caller; later callers get that error at once rather
    than waiting forever on a step thread that is gone."""
    engine = make_engine(opt, 32)

    def broken_step():
        raise RuntimeError("kernel exploded")

    engine.step = broken_step

    async def main():
        async with AsyncEngine(engine) as aeng:
            with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: kernel exploded"):
                await asyncio.wait_for(aeng.generate(prompt_of(4, 90), greedy(3)), 30)
            assert isinstance(aeng.error, RuntimeError)
            with pytest.raises(RuntimeError, match="failed earlier .*kernel exploded"):
                await asyncio.wait_for(aeng.generate(prompt_of(4, 91), greedy(3)), 30)

    asyncio.run(main())


def test_async_engine_keeps_no_record_of_the_requests_it_has_answered(opt):  # noqa: F811
    """A long-running front must not keep every request it served (the soak found a server's resident
    memory creeping by the engine's record of each finished request): finished, abandoned, failed and
    refused requests all leave ``engine.requests``; in-process callers keep theirs until ``forget``."""
    engine = make_engine(opt, 96)

    def boom(ids, logits):
        raise RuntimeError("processor bug")

    async def main():
        async with AsyncEngine(engine) as aeng:
            await asyncio.gather(*(aeng.generate(prompt_of(5, 300 + i), greedy(4)) for i in range(6)))
            left = aeng.stream(prompt_of(6, 320), greedy(50))
            await left.__anext__()
            await left.aclose()  # the caller went away after one token
            with pytest.raises(RequestError, match="processor bug"):
                await aeng.generate(prompt_of(3, 321), greedy(4, logits_processors=[boom]))
            with pytest.raises(ValueError, match="empty prompt"):
                await aeng.generate([], greedy(3))
            for _ in range(500):  # the step thread handles the abort a moment later
                if not engine.requests:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.requests == {}
    assert_pool_empty(engine)
    rid = engine.add_request(prompt_of(4, 330), greedy(40))
    engine.generate([prompt_of(4, 331)], greedy(2))
    assert len(engine.requests) == 2  # in-process: records stay readable until forgotten
    engine.forget(rid)  # still in flight: aborted, its blocks freed
    engine.forget("no-such-request")
    assert len(engine.requests) == 1
    engine.forget(next(iter(engine.requests)))
    assert engine.requests == {}
    assert_pool_empty(engine)
