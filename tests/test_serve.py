"""The OpenAI-compatible server, driven by the official ``openai`` client (and raw HTTP for
malformed input) on 127.0.0.1 with an ephemeral port: completions and chat, streamed and not,
equal to in-process generation; usage; stop strings; multi-byte text; n > 1; seeds; every
bad input gets its 4xx while the server keeps serving; timeouts, 429 and disconnects; a
bounded load test with a third of the clients leaving mid-stream."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.request

import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from serve_model import REPLAY, metrics, openai_client, post, running_server, tiny_chat_opt

MODEL = "tiny"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LOAD_PROMPTS = [f"Request {i}: tell me a story about the number {i * 7}" for i in range(24)]
SAMPLED = dict(temperature=1.0, seed=11)


class Refs:
    """In-process results, computed before the server takes over the engine."""

    def __init__(self, opt) -> None:
        self.opt, self.tok = opt, opt.tokenizer

    def ids(self, prompt) -> list[int]:
        return self.opt.chat_ids(prompt) if isinstance(prompt, list) else \
            self.tok(prompt, add_special_tokens=False)["input_ids"]

    def run(self, prompt, n: int, **sampling) -> tuple[str, int]:
        kw = {}
        if sampling:
            kw = dict(do_sample=True, temperature=sampling["temperature"], seed=sampling["seed"])
        out = self.opt.generate([self.ids(prompt)], max_new_tokens=n, **kw)[0]
        return self.tok.decode(out, skip_special_tokens=True), len(out)


@pytest.fixture(scope="module")
def refs():
    opt = tiny_chat_opt(num_kv_blocks=512, max_num_seqs=32)
    r = Refs(opt)
    r.completion = r.run("Once upon a time", 24)
    r.chat = r.run(CHAT, 24)
    r.replay = r.run("Tell me 日", 30)
    r.sampled = [r.run("Le café 日本", 40, temperature=1.0, seed=11 + i) for i in range(3)]
    r.load = [r.run(p, 8 + i % 12) for i, p in enumerate(LOAD_PROMPTS)]
    assert opt.engine.kv.allocator.num_used == 0
    return r


@pytest.fixture(scope="module")
def server(refs):
    with running_server(refs.opt, MODEL) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai_client(server)


def requests_with(server, status: int) -> float:
    m = metrics(server)
    return sum(v for k, v in m.items() if k.startswith("devin_requests_total{") and f'status="{status}"' in k)


async def wait_until(cond, limit_s: float = 10.0) -> None:
    for _ in range(int(limit_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    assert cond()


# ---------------------------------------------------------------- equal to in-process generation
def test_completions_match_in_process_greedy(refs, client):
    text, ntok = refs.completion
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    assert r.choices[0].text == text and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(refs.ids("Once upon a time")) and r.usage.completion_tokens == ntok
    assert r.usage.total_tokens == r.usage.prompt_tokens + ntok
    assert r.choices[0].finish_reason == ("length" if ntok == 24 else "stop")
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ntok
    assert sum(1 for c in chunks if c.choices) > 2


def test_chat_matches_in_process_greedy(refs, client):
    text, ntok = refs.chat
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(refs.ids(CHAT)) and r.usage.completion_tokens == ntok
    events = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] in ("stop", "length")
    assert events[-1].usage.total_tokens == r.usage.total_tokens


def test_stop_string_spanning_tokens(refs, client):
    text, _ = refs.completion
    pieces = [refs.tok.decode([t]) for t in refs.tok(text, add_special_tokens=False)["input_ids"]]
    edge = len(pieces[0]) + len(pieces[1])  # a token boundary inside the text
    stop = text[edge - 2: edge + 2]
    assert len(stop) == 4
    want = text[:text.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_multibyte_characters_stream_whole(refs, client):
    text, _ = refs.replay
    assert REPLAY.strip()[2:12] in text  # the model replays multi-byte text (serve_model.py)
    r = client.completions.create(model=MODEL, prompt="Tell me 日", max_tokens=30, temperature=0)
    assert r.choices[0].text == text
    parts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Tell me 日", max_tokens=30,
                                                                  temperature=0, stream=True)]
    # only the very end may be half a character: max_tokens ran out there, and the flush shows it as decode does
    assert "".join(parts) == text and "\ufffd" not in text[:-1] and all("\ufffd" not in p for p in parts[:-1])
    assert len(parts) < r.usage.completion_tokens  # tokens ending mid-character sent nothing on their own
    cut = client.completions.create(model=MODEL, prompt="Tell me 日", max_tokens=30, temperature=0, stop="ñ½")
    assert cut.choices[0].text == text  # no such stop: all of it
    cut = client.completions.create(model=MODEL, prompt="Tell me 日", max_tokens=30, temperature=0, stop="🙂 cafX")
    assert cut.choices[0].text == text  # held back while it could become the stop string, then released
    cut = client.completions.create(model=MODEL, prompt="Tell me 日", max_tokens=30, temperature=0, stop="é ñ")
    assert cut.choices[0].text == text[:text.index("é ñ")] and cut.choices[0].finish_reason == "stop"


def test_sampled_n_and_seeds(refs, client):
    kw = dict(model=MODEL, prompt="Le café 日本", max_tokens=40, n=3, **SAMPLED)
    r = client.completions.create(**kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == [t for t, _ in refs.sampled]  # choice i is seeded seed + i, as in-process
    assert len(set(texts)) == 3
    assert r.usage.completion_tokens == sum(n for _, n in refs.sampled)
    assert r.usage.prompt_tokens == len(refs.ids("Le café 日本"))
    assert [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)] == texts
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for c in client.completions.create(**kw, stream=True):
        parts[c.choices[0].index].append(c.choices[0].text)
    assert ["".join(parts[i]) for i in range(3)] == texts
    for i in range(3):
        if "\ufffd" not in texts[i]:
            assert all("\ufffd" not in p for p in parts[i])
    other = client.completions.create(**{**kw, "seed": 12, "n": 1})
    assert other.choices[0].text == texts[1]


# ---------------------------------------------------------------- bad input: a 4xx each, the server goes on
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [99_999_999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "warm"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": True}, 400, "speculative"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "kv_prune": {"threshold": 0.1}}, 400, "kv_prune"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": "2"}, 400, "n"),
    ("/v1/nowhere", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input_gets_its_4xx_and_the_server_keeps_serving(refs, server, client, path, body, status, param):
    code, _, err = post(server, path, body, raw=isinstance(body, bytes))
    assert code == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    assert r.choices[0].text == refs.completion[0]


def test_openai_client_raises_its_own_errors(client):
    with pytest.raises(BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=CHAT)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_health(server):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


# ---------------------------------------------------------------- timeout, queue limit, disconnects
def test_timeout_fails_only_that_request(refs, server):
    async def main():
        slow = asyncio.to_thread(post, server, "/v1/completions",
                                 {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                  "timeout": 0.05})
        ok = asyncio.to_thread(post, server, "/v1/completions",
                               {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0})
        return await asyncio.wait_for(asyncio.gather(slow, ok), 120)

    (code, _, err), (ok_code, _, ok) = asyncio.run(main())
    assert code == 408 and err["error"]["param"] == "timeout"
    assert ok_code == 200 and ok["choices"][0]["text"] == refs.completion[0]
    asyncio.run(wait_until(lambda: metrics(server)["devin_kv_blocks_used"] == 0))


def test_full_queue_answers_429_with_retry_after(server):
    server.max_queue = 1
    try:
        code, headers, err = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2})
        assert code == 429 and headers["Retry-After"] == "1" and "--max-queue" in err["error"]["message"]
        assert post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        server.max_queue = None


def test_non_streamed_client_disconnect_aborts(server):
    before = requests_with(server, 499)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 250, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        asyncio.run(wait_until(lambda: metrics(server)["devin_kv_blocks_used"] > 0))
    asyncio.run(wait_until(lambda: requests_with(server, 499) == before + 1))
    asyncio.run(wait_until(lambda: metrics(server)["devin_kv_blocks_used"] == 0))


def test_load_with_a_third_disconnecting_mid_stream(refs, server):
    ok_before, gone_before = requests_with(server, 200), requests_with(server, 499)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def one(i: int):
        leaves = i % 3 == 0
        kw = dict(max_tokens=200, ignore_eos=True) if leaves else dict(max_tokens=8 + i % 12)
        stream = await client.completions.create(model=MODEL, prompt=LOAD_PROMPTS[i], temperature=0, stream=True,
                                                 extra_body={k: v for k, v in kw.items() if k == "ignore_eos"},
                                                 max_tokens=kw["max_tokens"])
        parts, got = [], 0
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            got += 1
            if leaves and got == 3:
                await stream.close()
                return None
        return "".join(parts)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(LOAD_PROMPTS)))), 300)

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 3:
            assert text == refs.load[i][0], i
        else:
            assert text is None
    left = len(LOAD_PROMPTS) // 3
    asyncio.run(wait_until(lambda: requests_with(server, 499) == gone_before + left, 20))
    assert requests_with(server, 200) == ok_before + len(LOAD_PROMPTS) - left
    asyncio.run(wait_until(lambda: metrics(server)["devin_kv_blocks_used"] == 0))
    m = metrics(server)
    assert m["devin_queue_requests"] == 0 and m["devin_running_sequences"] == 0
    assert m["devin_kv_blocks_total"] == 512
    assert m["devin_generation_tokens_total"] > 0 and m["devin_time_to_first_token_seconds_count"] > 0
    assert re.search(r"devin_inter_token_latency_seconds_bucket", "\n".join(m))


# ---------------------------------------------------------------- traces
def test_request_span_has_genai_attributes_and_the_clients_trace_id(server, client):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from devin_compile.serve.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    server.tracing = Tracing(provider)
    try:
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True,
                                           extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
        assert list(r)
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
        with pytest.raises(BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=9999)
    finally:
        server.tracing = None
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [f"chat {MODEL}", f"text_completion {MODEL}", f"text_completion {MODEL}"]
    chat, plain, refused = spans
    assert format(chat.context.trace_id, "032x") == trace_id and format(chat.parent.span_id, "016x") == parent_id
    assert plain.parent is None and plain.context.trace_id != chat.context.trace_id
    a = chat.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.stream"] is True
    assert a["gen_ai.usage.input_tokens"] == len(server.opt.chat_ids(CHAT))
    assert 1 <= a["gen_ai.usage.output_tokens"] <= 6 and a["http.response.status_code"] == 200
    assert a["gen_ai.response.id"].startswith("chatcmpl-")
    names = [e.name for e in chat.events]
    assert names[0] == "scheduled" and "first_token" in names and names[-1] == "finished"
    assert chat.start_time <= chat.events[0].timestamp <= chat.events[-1].timestamp <= chat.end_time
    assert refused.attributes["http.response.status_code"] == 400 and not refused.status.is_ok


def test_trace_file_gets_json_lines_and_tracing_is_off_by_default(server, client, tmp_path, monkeypatch):
    from devin_compile.serve.tracing import make_tracing

    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert make_tracing(None) is None and server.tracing is None
    path = tmp_path / "spans.jsonl"
    server.tracing = make_tracing(str(path))
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, seed=4)
    finally:
        tracing, server.tracing = server.tracing, None
        tracing.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    span = json.loads(lines[0])
    assert span["name"] == f"text_completion {MODEL}" and span["attributes"]["gen_ai.request.seed"] == 4
    assert span["attributes"]["gen_ai.usage.input_tokens"] == 1


def test_kv_tier_metrics_and_restore_through_the_server():
    """A server over an engine with a host KV tier: a prefix the small pool evicts comes back
    from the tier (same text as the first answer), and /metrics shows the tier's counters."""
    opt = tiny_chat_opt(num_kv_blocks=10, block_size=4, max_num_seqs=4,
                        kv_cache_tiers=[{"backend": "host_lru", "max_bytes": 1 << 22}])
    prompt = "Once upon a time there was a story about a very long preamble that fills several blocks"
    filler = "Tell me about the sea and the mountains and the rivers and the old towns by the coast, slowly"
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from devin_compile.serve.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with running_server(opt, MODEL, tracing=Tracing(provider)) as srv:
        c = openai_client(srv)
        first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        c.completions.create(model=MODEL, prompt=filler, max_tokens=6, temperature=0)
        again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        m = metrics(srv)
    assert again == first
    assert m['devin_kv_tier_hits_total{tier="0:host_lru"}'] >= 1
    assert m['devin_kv_tier_bytes{tier="0:host_lru"}'] > 0
    assert m['devin_kv_tier_rejected_total{tier="0:host_lru"}'] == 0
    last = exporter.get_finished_spans()[-1]  # the third request's span marks the tier hit
    hits = [e for e in last.events if e.name == "kv_tier_hit"]
    assert hits and hits[0].attributes["tokens"] >= 4


def test_serve_cli_kv_cache_tier_flags():
    from devin_compile.cli import serve as serve_cli

    p = __import__("argparse").ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(["--kv-cache-host-bytes", "1048576", "--kv-cache-redis", "redis://127.0.0.1:6379/0"])
    tiers = serve_cli.optimize_options(args)["kv_cache_tiers"]
    assert [t["backend"] if isinstance(t, dict) else t.backend for t in tiers] == ["host_lru", "redis"]


# ---------------------------------------------------------------- /tokenize and /detokenize (vLLM's shapes)
def test_tokenize_and_detokenize_match_the_tokenizer_and_what_generation_uses(refs, server):
    tok = refs.opt.tokenizer
    text = "Once upon a time" + REPLAY
    code, _, body = post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False,
                                               "return_token_strs": True})
    assert code == 200, body
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert body == {"count": len(ids), "max_model_len": refs.opt.engine.max_model_len, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids)}
    code, _, body = post(server, "/tokenize", {"prompt": text})  # model is optional; special tokens by default
    assert code == 200 and body["tokens"] == tok(text)["input_ids"] and body["token_strs"] is None
    code, _, chat = post(server, "/tokenize", {"messages": CHAT})  # what /v1/chat/completions would run
    assert code == 200 and chat["tokens"] == refs.opt.chat_ids(CHAT)
    code, _, open_turn = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert code == 200 and open_turn["count"] < chat["count"] and chat["tokens"][:open_turn["count"]] == open_turn["tokens"]
    code, _, back = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert code == 200 and back == {"prompt": tok.decode(ids)} and back["prompt"] == text


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "stream": True}, 400, "stream"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [99_999_999]}, 400, "tokens"),
])
def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(server, path, body, status, param):
    code, _, err = post(server, path, body)
    assert code == status and err["error"]["param"] == param and err["error"]["message"], err
    assert requests_with(server, status) >= 1
