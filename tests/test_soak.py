"""A soak with faults on the tiny model (``bench/soak.py`` is the same soak on SmolLM2): 150 requests
against one in-process server on 127.0.0.1 whose engine has a Redis KV tier, prompts and lengths from
``../shared/workloads``, 8 in flight, streamed and not; 20% of the clients leave mid-stream, 5% send
malformed bodies (bad JSON, wrong types, unknown fields, an unknown model, a body past
``max_body_bytes``), a few ask for ``n`` > 1 sampled choices with logprobs; Redis is killed (SIGKILL)
after half the requests and restarted after 60%. Asserted (``bench/soaklib/checks.py``): every request
not cut off completes (200, or its 4xx), greedy and seeded answers equal the in-process engine's, no
KV block is held at the end and the engine keeps no record of any request, no 5xx, resident memory
(this process: the server runs in a thread here) grows at most 5% after warm-up, ``/health`` answers,
and the Redis tier felt the outage.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from redis_server import RedisServer, require_redis_server
from serve_model import running_server, tiny_chat_opt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from soaklib.checks import problems, summary  # noqa: E402
from soaklib.driver import Fault, soak  # noqa: E402
from soaklib.observe import health, rss_bytes  # noqa: E402
from soaklib.plan import build_plan, load_rows  # noqa: E402
from soaklib.reference import reference  # noqa: E402

WORKLOADS = ROOT.parent / "shared" / "workloads"
REQUESTS, WARMUP, CONCURRENCY, MAX_TOKENS, MAX_BODY = 150, 30, 8, 24, 1 << 16
MODEL = "tiny"


# The rows of mixed-64 and mixed-16 with at most 128 prompt tokens, copied, for a checkout without ../shared
SHIPPED = Path(__file__).resolve().parent / "data" / "soak_workload.jsonl"


def workload_rows() -> list[dict]:
    paths = [WORKLOADS / "mixed-64.jsonl", WORKLOADS / "mixed-16.jsonl"]
    if not all(p.exists() for p in paths):
        paths = [SHIPPED]
    return load_rows(paths, max_prompt_tokens=128)  # + 31 chat-template tokens + 24 new: within 256


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(require_redis_server(), tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_soak_with_faults(redis):
    from devin_compile.serve.limits import ServeLimits

    plan = build_plan(workload_rows(), REQUESTS, MODEL, max_tokens=MAX_TOKENS, seed=0, max_body=MAX_BODY)
    refs = reference(tiny_chat_opt(num_kv_blocks=256), plan)
    # a pool of 64 blocks (1024 tokens) for 8 requests of up to ~180 tokens: prefixes are evicted and
    # come back from Redis, and a long request can preempt another
    opt = tiny_chat_opt(num_kv_blocks=64, max_num_seqs=8,
                        kv_cache_tiers=[{"backend": "redis", "url": redis.url}])
    faults = [Fault(REQUESTS // 2, "redis killed", redis.kill),
              Fault(REQUESTS * 6 // 10, "redis restarted", redis.start)]
    with running_server(opt, MODEL, limits=ServeLimits(max_body_bytes=MAX_BODY)) as srv:
        run = asyncio.run(soak(srv.url, plan, concurrency=CONCURRENCY, warmup=WARMUP, faults=faults,
                               rss=rss_bytes, time_limit_s=600))
        health_status = asyncio.run(health(srv.url))
    figures = summary(plan, run)
    assert problems(plan, run, refs) == [], figures
    assert health_status == 200
    assert opt.engine.requests == {}  # the server kept no record of the requests it answered
    assert [f["name"] for f in run.faults] == ["redis killed", "redis restarted"]
    assert figures["by_kind"] == {"cut": 30, "greedy": 108, "malformed": 8, "multi": 4}
    assert figures["kv_tiers"]['errors_total{tier="0:redis"}'] > 0  # the outage was felt, and survived
    assert figures["streams_cut"] > 0 and figures["ttft"]["samples"] > 0 and figures["inter_token"]["samples"] > 0


def test_the_verdict_catches_each_kind_of_failure():
    """``problems`` is what the soak asserts on: each kind of failure it must catch, on a made-up run."""
    from soaklib.client import Outcome
    from soaklib.driver import SoakRun
    from soaklib.reference import Expected, key

    rows = [{"id": "r", "prompt": "Hi", "max_new_tokens": 4, "prompt_tokens": 1}]
    plan = build_plan(rows, 20, MODEL, max_tokens=4, seed=1)
    refs = {key(it): Expected(["abcd"] * it.n, [4] * it.n, [[-0.5] * 4] * it.n if it.logprobs is not None else None)
            for it in plan if it.checked}

    def good(it) -> Outcome:
        if it.kind.startswith("malformed:"):
            return Outcome(it.index, it.expect_status, param=it.expect_param, done=True)
        if it.kind == "cut":
            return Outcome(it.index, 200, cut=True)
        lps = {i: [-0.5] * 4 for i in range(it.n)} if it.logprobs is not None else {}
        return Outcome(it.index, 200, {i: "abcd" for i in range(it.n)}, {i: "length" for i in range(it.n)}, lps,
                       {"completion_tokens": 4 * it.n}, done=True)

    idle = {"devin_kv_blocks_used": 0, "devin_running_sequences": 0, "devin_queue_requests": 0,
            'devin_requests_total{endpoint="chat",status="200"}': sum(not it.kind.startswith("malformed:")
                                                                      for it in plan)}

    def run(outs=None, metrics=None, rss_end=100) -> SoakRun:
        return SoakRun(outs or [good(it) for it in plan], [], 100, rss_end, [], {**idle, **(metrics or {})}, 1.0, 0.1)

    assert problems(plan, run(), refs) == []
    kinds = {it.kind.split(":")[0]: it for it in plan}
    assert set(kinds) == {"greedy", "cut", "multi", "malformed"}
    breaks = [("greedy", lambda o: o.texts.update({0: "abce"})), ("greedy", lambda o: setattr(o, "done", False)),
              ("greedy", lambda o: o.usage.update(completion_tokens=3)),
              ("greedy", lambda o: o.finish.update({0: "stop"})),
              ("greedy", lambda o: setattr(o, "error", "client: ConnectionResetError")),
              ("multi", lambda o: o.logprobs.update({1: [-0.5, -0.5, -0.4, -0.5]})),
              ("multi", lambda o: o.logprobs.update({0: [-0.5] * 3})),
              ("malformed", lambda o: setattr(o, "status", 500)),
              ("cut", lambda o: setattr(o, "cut", False)), ("cut", lambda o: setattr(o, "status", 503))]
    for kind, breaking in breaks:
        outs = [good(it) for it in plan]
        breaking(outs[kinds[kind].index])
        assert len(problems(plan, run(outs), refs)) == 1, kind
    assert problems(plan, run(metrics={"devin_kv_blocks_used": 3}), refs)
    assert problems(plan, run(metrics={'devin_requests_total{endpoint="chat",status="500"}': 1}), refs)
    assert problems(plan, run(rss_end=106), refs) and not problems(plan, run(rss_end=105), refs)
