"""The server's logprobs, speculative extra field, speculation metrics and --trace-steps spans, on
the tiny model with SmolLM2's tokenizer optimized with n-gram speculation, driven by the official
``openai`` client on 127.0.0.1 (ephemeral port): logprobs for completions and chat, streamed and
not, equal to the engine's in-process values; ``speculative`` false / true / an object gives the
same greedy text, a bad value is a 400 naming it; the spec counters grow; step spans are children
of their request's span, in the client's trace."""
from __future__ import annotations

import pytest
from openai import BadRequestError

from devin_compile.runtime.sampling import SamplingParams
from serve_model import REPLAY, metrics, openai_client, post, running_server, tiny_chat_opt

MODEL = "tiny"
PROMPT = "Tell me 日"  # continues with REPLAY: multi-byte characters split across tokens
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
REPEAT = REPLAY * 2  # the n-gram proposer finds its continuation at once
K = 3
N = 24


@pytest.fixture(scope="module")
def opt():
    return tiny_chat_opt(num_kv_blocks=256, max_num_seqs=16, speculative={"method": "ngram", "num_tokens": 4})


@pytest.fixture(scope="module")
def refs(opt):
    """In-process outputs (logprobs on), computed before the server takes over the engine."""
    tok = opt.tokenizer
    params = SamplingParams(max_new_tokens=N, logprobs=K)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    completion, chat = opt.engine.generate([ids, opt.chat_ids(CHAT)], params)
    assert completion.logprobs and chat.logprobs
    return {"completion": completion, "chat": chat}


@pytest.fixture(scope="module")
def server(opt, refs):
    with running_server(opt, MODEL) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai_client(server)


def _piece(server, t: int) -> str:
    return server.tokenizer.decode([t])


# ---------------------------------------------------------------- logprobs
def _check_completion_logprobs(server, lp, ref) -> None:
    assert lp.tokens == [_piece(server, t) for t in ref.output_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    for top, e in zip(lp.top_logprobs, ref.logprobs):
        want = {_piece(server, t): v for t, v in e.top}
        want.setdefault(_piece(server, e.token_id), e.logprob)
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(list(want.values()), abs=1e-4)
    offsets = [0]
    for s in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp.text_offset == offsets


def test_completion_logprobs_equal_in_process(server, client, refs):
    ref = refs["completion"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=K)
    c = r.choices[0]
    assert c.text == server.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
    _check_completion_logprobs(server, c.logprobs, ref)
    # streamed: the chunks' logprobs concatenate to the same lists (text offsets carried on)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=K,
                                           stream=True):
        lp = chunk.choices[0].logprobs
        assert lp is not None
        for key in merged:
            merged[key] += getattr(lp, key)
    assert merged == c.logprobs.model_dump()
    # without logprobs: null, as before
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].logprobs \
        is None


def _check_chat_content(server, content, ref) -> None:
    assert [x.token for x in content] == [_piece(server, t) for t in ref.output_ids]
    assert [x.logprob for x in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    for x, e in zip(content, ref.logprobs):
        assert x.bytes == list(x.token.encode("utf-8"))
        assert [a.token for a in x.top_logprobs] == [_piece(server, t) for t, _ in e.top]
        assert [a.logprob for a in x.top_logprobs] == pytest.approx([v for _, v in e.top], abs=1e-4)


def test_chat_logprobs_equal_in_process(server, client, refs):
    ref = refs["chat"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0, logprobs=True,
                                       top_logprobs=K)
    _check_chat_content(server, r.choices[0].logprobs.content, ref)
    content = []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0,
                                                logprobs=True, top_logprobs=K, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content += chunk.choices[0].logprobs.content
    _check_chat_content(server, content, ref)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    assert len(r.choices[0].logprobs.content) == 4 and all(x.top_logprobs == [] for x in r.choices[0].logprobs.content)


# ---------------------------------------------------------------- speculative extra field, metrics
def test_speculative_field_keeps_greedy_text_and_counts(server, client):
    before = metrics(server)
    kw = dict(model=MODEL, prompt=REPEAT, max_tokens=30, temperature=0)
    texts = [client.completions.create(**kw, extra_body=extra).choices[0].text
             for extra in ({}, {"speculative": False}, {"speculative": True},
                           {"speculative": {"num_tokens": 2, "acceptance_threshold": 0.0, "adaptive": False}})]
    assert len(set(texts)) == 1 and texts[0]
    after = metrics(server)
    drafted = after["devin_spec_draft_tokens_total"] - before["devin_spec_draft_tokens_total"]
    accepted = after["devin_spec_accepted_tokens_total"] - before["devin_spec_accepted_tokens_total"]
    assert drafted > 0 and 0 < accepted <= drafted


def test_bad_speculative_is_a_400_naming_it(server, client):
    for bad in ({"num_tokens": 0}, {"depth": 2}, "yes", 3):
        code, _, err = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "speculative": bad})
        assert code == 400 and err["error"]["param"] == "speculative", err
    with pytest.raises(BadRequestError, match="speculative"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"speculative": {"acceptance_threshold": 2}})
    # a model with no proposer (hot-swapped off) refuses speculative: true, still accepts false
    engine = server.opt.engine
    proposer = engine.spec.proposer
    engine.set_proposer(None)
    try:
        code, _, err = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "speculative": True})
        assert code == 400 and err["error"]["param"] == "speculative"
        assert post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                      "speculative": False})[0] == 200
    finally:
        engine.set_proposer(proposer)


# ---------------------------------------------------------------- traces: spec attributes, step spans
def _tracing(trace_steps: bool):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from devin_compile.serve.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, trace_steps=trace_steps), exporter


def test_trace_steps_are_children_of_the_request_span(server, client):
    engine = server.opt.engine
    assert not engine.step_hooks  # nothing traced with trace_steps yet: the engine has no hook
    server.tracing, exporter = _tracing(trace_steps=False)
    try:
        client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=12, temperature=0)
        assert not engine.step_hooks  # tracing without trace_steps adds none either
        (plain,) = exporter.get_finished_spans()
        assert plain.attributes["devin.spec.drafted_tokens"] > 0
        assert 0 < plain.attributes["devin.spec.acceptance_rate"] <= 1
        assert plain.attributes["devin.spec.proposer"] == "ngram"
        server.tracing, exporter = _tracing(trace_steps=True)
        trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        r = client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=12, temperature=0, n=2,
                                      extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
        assert len(r.choices) == 2
    finally:
        server.tracing = None
    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.name == f"text_completion {MODEL}"]
    steps = [s for s in spans if s.name == "devin.engine.step"]
    assert format(request.context.trace_id, "032x") == trace_id
    assert steps and all(s.parent.span_id == request.context.span_id for s in steps)
    assert all(s.context.trace_id == request.context.trace_id for s in steps)
    per_choice = {}
    for s in steps:
        per_choice.setdefault(s.attributes["devin.request.id"], []).append(s)
    assert len(per_choice) == 2
    for choice_steps in per_choice.values():
        a = [s.attributes for s in choice_steps]
        idx = [x["devin.step.index"] for x in a]
        assert idx == sorted(idx) and len(set(idx)) == len(idx)
        assert a[0]["devin.step.prefill_tokens"] > 0 and a[0]["devin.step.batch_size"] >= 1
        assert any(x["devin.step.decode_tokens"] > 0 for x in a)
        assert sum(x["devin.step.accepted_tokens"] for x in a) > 0
        assert all(x["devin.step.accepted_tokens"] <= x["devin.step.drafted_tokens"] for x in a)
        assert all(request.start_time <= s.start_time <= s.end_time <= request.end_time for s in choice_steps)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)  # tracing off again
    assert len(exporter.get_finished_spans()) == len(spans)  # the hook stays, but makes no span
