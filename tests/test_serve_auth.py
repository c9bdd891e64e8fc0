"""The server's front door on the tiny model, 127.0.0.1 and ephemeral ports: API keys (401 in
OpenAI's shape on every guarded path, open /health and /metrics, --metrics-auth, keys never in a
log), limits (413 for bodies announced or streamed past the limit, prompt tokens, n, max_tokens,
open connections → 503), the access log, and refusals worded for HTTP users."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import socket

import openai
import pytest

from devin_compile.runtime.admission import AdmissionCheck, RequestRejected
from devin_compile.runtime.sampling import SamplingParams
from devin_compile.serve.access_log import LOGGER
from devin_compile.serve.app import Server
from devin_compile.serve.auth import BearerKeys
from devin_compile.serve.limits import ServeLimits
from devin_compile.serve.refusals import http_refusal
from serve_model import openai_client, post, running_server, tiny_chat_opt

MODEL = "tiny"
KEYS = ["k1-0123456789abcdef", "k2-fedcba9876543210"]
CHAT = [{"role": "user", "content": "Hi"}]
GUARDED = [("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
           ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
           ("/v1/models", None), ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]
SMALL = ServeLimits(max_body_bytes=2000, max_prompt_tokens=64, max_n=2, max_tokens=8, max_connections=3)


@pytest.fixture(scope="module")
def opt():
    """For the servers a test starts and stops (an engine is stepped by one server at a time)."""
    return tiny_chat_opt(num_kv_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def guarded():
    opt = tiny_chat_opt(num_kv_blocks=64, max_num_seqs=8)
    with running_server(opt, MODEL, api_keys=KEYS, limits=SMALL, access_log=True) as srv:
        yield srv


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def get(server, path: str, headers: dict | None = None) -> int:
    return post(server, path, None, headers=headers)[0] if path != "/metrics" else _raw_status(server, path, headers)


def _raw_status(server, path: str, headers: dict | None) -> int:
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    with socket.create_connection(_addr(server), timeout=30) as s:
        return _exchange(s, f"GET {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())[0]


def _addr(server) -> tuple[str, int]:
    return "127.0.0.1", int(server.url.rsplit(":", 1)[1])


def _exchange(sock: socket.socket, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` on a keep-alive connection and read one response: (status, body)."""
    sock.sendall(data)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


# ---------------------------------------------------------------- API keys
@pytest.mark.parametrize("path, body", GUARDED + [("/v1/nowhere", None)])
def test_every_guarded_path_needs_one_of_the_keys(guarded, path, body):
    for headers in (None, bearer("k1-wrong"), {"Authorization": f"Basic {KEYS[0]}"}, bearer(KEYS[0] + "x")):
        code, resp_headers, err = post(guarded, path, body, headers=headers)
        assert code == 401 and resp_headers["WWW-Authenticate"] == "Bearer", (path, headers)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in err["error"]["message"] and KEYS[0] not in json.dumps(err)
    if path != "/v1/nowhere":
        for key in KEYS:
            assert post(guarded, path, body, headers=bearer(key))[0] == 200


def test_health_and_metrics_stay_open_and_the_openai_client_sends_its_key(guarded):
    assert get(guarded, "/health") == 200 and get(guarded, "/metrics") == 200
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEYS[1], max_retries=0, timeout=60) as ok:
        assert ok.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    with openai_client(guarded) as wrong, pytest.raises(openai.AuthenticationError, match="invalid API key"):
        wrong.models.list()


def test_metrics_auth_puts_metrics_behind_the_key(opt):
    with running_server(opt, MODEL, api_keys=KEYS[:1], metrics_auth=True) as srv:
        assert get(srv, "/metrics") == 401 and get(srv, "/metrics", bearer(KEYS[0])) == 200
        assert get(srv, "/health") == 200
    with pytest.raises(ValueError, match="--metrics-auth"):
        Server(opt, MODEL, metrics_auth=True)


def test_keys_are_compared_as_digests_against_every_key():
    keys = BearerKeys(KEYS)
    assert keys.matches(KEYS[1].encode()) and not keys.matches(b"k2-") and not keys.matches(b"")
    assert KEYS[0] not in repr(keys) and KEYS[0] not in repr(vars(keys))
    for bad in ("", "two words", "caf\u00e9"):
        with pytest.raises(ValueError, match="printable ASCII") as e:
            BearerKeys([bad])
        assert bad == "" or bad not in str(e.value)


def test_no_key_reaches_a_log(opt, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    with running_server(opt, MODEL, api_keys=KEYS, access_log=True) as srv:
        for key in KEYS + ["k1-wrong"]:
            post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=bearer(key))
        post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, headers=bearer(KEYS[0]))
    out, err = capfd.readouterr()
    logged = caplog.text + out + err + "".join(str(r.args) for r in caplog.records)
    assert "POST /v1/completions 401" in logged and "POST /v1/completions 400" in logged
    assert not any(k in logged for k in KEYS)


# ---------------------------------------------------------------- limits
def test_body_over_the_limit_is_a_413_announced_or_streamed(guarded):
    big = {"model": MODEL, "prompt": "x" * 3000}
    code, _, err = post(guarded, "/v1/completions", big, headers=bearer(KEYS[0]))
    assert code == 413 and err["error"]["code"] == "request_too_large" and "--max-body-bytes" in err["error"]["message"]
    assert post(guarded, "/tokenize", {"prompt": "y" * 3000}, headers=bearer(KEYS[0]))[0] == 413
    with socket.create_connection(_addr(guarded), timeout=30) as s:  # chunked: no Content-Length to read
        chunk = b"3e8\r\n" + b" " * 1000 + b"\r\n"
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nAuthorization: Bearer "
        status, body = _exchange(s, head + KEYS[0].encode() + b"\r\n\r\n" + chunk * 3 + b"0\r\n\r\n")
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert post(guarded, *GUARDED[0], headers=bearer(KEYS[0]))[0] == 200


@pytest.mark.parametrize("path, body, param, flag", [
    ("/v1/completions", {"prompt": "word " * 65}, "prompt", "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": ["word " * 33, "word " * 33]}, "prompt", "--max-prompt-tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 50}]}, "messages",
     "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": "x", "n": 3}, "n", "--max-n"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 9}, "max_tokens", "--max-tokens-limit"),
])
def test_request_limits_are_400s_naming_the_field_and_the_flag(guarded, path, body, param, flag):
    code, _, err = post(guarded, path, {"model": MODEL, **body}, headers=bearer(KEYS[0]))
    assert code == 400 and err["error"]["param"] == param and flag in err["error"]["message"], err


def test_max_tokens_limit_caps_the_chat_default(guarded):
    code, _, r = post(guarded, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "ignore_eos": True},
                      headers=bearer(KEYS[0]))
    assert code == 200 and r["usage"]["completion_tokens"] == SMALL.max_tokens


async def _wait(cond, limit_s: float = 10.0) -> None:
    for _ in range(int(limit_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    assert cond()


def test_connections_past_the_limit_get_503_until_one_closes(guarded):
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    held: list[socket.socket] = []

    def seat() -> bool:  # a connection that was served (a 503 closes it): earlier tests' may still be closing
        s = socket.create_connection(_addr(guarded), timeout=30)
        if _exchange(s, health)[0] == 200:
            held.append(s)
            return True
        s.close()
        return False

    try:
        for _ in range(SMALL.max_connections):
            asyncio.run(_wait(seat))
        with socket.create_connection(_addr(guarded), timeout=30) as extra:
            assert _exchange(extra, health)[0] == 503
        held.pop().close()

        def served() -> bool:
            with socket.create_connection(_addr(guarded), timeout=30) as s:
                return _exchange(s, health)[0] == 200

        asyncio.run(_wait(served))
        assert [_exchange(s, health)[0] for s in held] == [200] * len(held)  # the others kept their seats
    finally:
        for s in held:
            s.close()


# ---------------------------------------------------------------- access log, wording
def test_access_log_line_per_request_with_tokens_status_and_latency(guarded, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    code, _, r = post(guarded, "/v1/completions", {"model": MODEL, "prompt": "Tell me", "max_tokens": 4,
                                                   "ignore_eos": True}, headers=bearer(KEYS[0]))
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=60) as client:
        list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert code == 200
    post(guarded, "/v1/nowhere", {}, headers=bearer(KEYS[0]))
    post(guarded, "/v1/models", None)

    patterns = [rf"POST /v1/completions 200 tokens {r['usage']['prompt_tokens']}/4",
                r"POST /v1/chat/completions 200 tokens \d+/3", "POST /v1/nowhere 404 tokens -",
                "GET /v1/models 401 tokens -"]

    def counts() -> list[int]:  # a stream's line is written once its last event is sent: maybe after the next
        lines = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
        return [sum(bool(re.fullmatch(rf"127\.0\.0\.1:\d+ {p} \d+\.\d{{3}}s", x)) for x in lines) for p in patterns]

    asyncio.run(_wait(lambda: all(counts())))
    assert counts() == [1, 1, 1, 1], caplog.text


def test_refusals_speak_of_request_fields_and_server_flags(opt):
    with running_server(opt, MODEL) as srv:  # no proposer, no KV pruning
        for body, param, way_out in [({"speculative": True}, "speculative", "--speculative ngram"),
                                     ({"kv_prune": {"threshold": 0.1}}, "kv_prune", "--option 'kv_prune="),
                                     ({"presence_penalty": 0.5}, "presence_penalty", "leave it out")]:
            code, _, err = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", **body})
            msg = err["error"]["message"]
            assert code == 400 and err["error"]["param"] == param and way_out in msg, msg
            assert not re.search(r"optimize\(|SamplingParams|sampler|max_new_tokens", msg), msg
    check = AdmissionCheck(max_model_len=100, pool_tokens=60, vocab_size=50)
    for new, code, words in [(95, "context_exceeded", "context of 100"), (55, "pool_exceeded", "--num-kv-blocks")]:
        with pytest.raises(RequestRejected) as e:
            check.check([1] * 10, SamplingParams(max_new_tokens=new), can_speculate=False)
        assert e.value.code == code and "max_new_tokens" in str(e.value)  # the Python caller's words
        http = http_refusal(e.value.prefixed("request 3: "), "messages")
        assert http.param == "max_tokens" and words in http.message and "max_new_tokens" not in http.message
        assert "messages (10 tokens) + max_tokens" in http.message


def test_access_log_says_499_when_the_client_leaves(opt, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}).encode()
    with running_server(opt, MODEL, access_log=True) as srv:
        with socket.create_connection(_addr(srv), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")  # the stream has begun; leave mid-way

        def lines() -> list[str]:
            return [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]

        asyncio.run(_wait(lambda: len(lines()) == 1))
    assert re.fullmatch(r"127\.0\.0\.1:\d+ POST /v1/completions 499 tokens 1/\d+ \d+\.\d{3}s", lines()[0]), lines()
    assert int(lines()[0].split()[5].split("/")[1]) < 240
