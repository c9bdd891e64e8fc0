"""``/openapi.json`` against what the server does: the request schemas hold exactly the fields
protocol.py reads (and nothing else is accepted), and schemathesis, fuzzing every operation of a
live keyed server on 127.0.0.1 with a bounded number of examples, finds no 5xx, no response
outside its schema, no schema-invalid request accepted and no operation open without the key;
the server answers /health and generates as before afterwards, with every KV block free."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from devin_compile.serve import request_fields as rf
from devin_compile.serve.limits import ServeLimits
from devin_compile.serve.protocol import APIError, parse_request
from devin_compile.serve.tokenizer_endpoints import detokenize, tokenize
from serve_model import post, running_server, smollm2_tokenizer, tiny_chat_opt

MODEL = "tiny"
KEY = "sk-fuzz-0123456789"
LIMITS = ServeLimits(max_body_bytes=16384, max_prompt_tokens=128, max_n=2, max_tokens=8)
FUZZ_CONFIG = """
[checks.negative_data_rejection]
expected-statuses = [400, 401, 404, 405, 413]
"""


@pytest.fixture(scope="module")
def server():
    opt = tiny_chat_opt(num_kv_blocks=64, max_num_seqs=8)
    with running_server(opt, MODEL, api_keys=[KEY], limits=LIMITS) as srv:
        srv.opt = opt
        yield srv


def get_json(server, path: str):
    with urllib.request.urlopen(server.url + path, timeout=30) as r:
        return r.status, r.headers["Content-Type"], json.loads(r.read())


class Reads(dict):
    """A request body that records every field name the parser looks up."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def test_request_schemas_hold_exactly_the_fields_the_parsers_read(server):
    msgs = [{"role": "user", "content": "x"}]
    tok = smollm2_tokenizer()
    cases = [(rf.COMPLETION, lambda b: parse_request(b, chat=False), {"model": "m", "prompt": "x", "stream": True}),
             (rf.CHAT, lambda b: parse_request(b, chat=True), {"model": "m", "messages": msgs, "stream": True}),
             (rf.TOKENIZE_PROMPT, lambda b: tokenize(b, tok, "m", 64), {"prompt": "x"}),
             (rf.TOKENIZE_CHAT, lambda b: tokenize(b, tok, "m", 64), {"messages": msgs}),
             (rf.DETOKENIZE, lambda b: detokenize(b, tok, "m"), {"tokens": [1]})]
    for fields, parse, body in cases:
        reads = Reads(body)
        parse(reads)
        asked = reads.read - ({"messages"} if fields is rf.TOKENIZE_PROMPT else set())  # which /tokenize form
        assert asked == set(fields), sorted(asked ^ set(fields))
        with pytest.raises(APIError) as e:  # a field the table lacks is refused, named
            parse({**body, "frobnicate": 1})
        assert e.value.status == 400 and e.value.param == "frobnicate" and "openapi.json" in e.value.message
    status, ctype, doc = get_json(server, "/openapi.json")  # open without the key
    assert status == 200 and ctype == "application/json" and doc["openapi"] == "3.1.0"
    for path, fields in [("/v1/completions", rf.COMPLETION), ("/v1/chat/completions", rf.CHAT),
                         ("/detokenize", rf.DETOKENIZE)]:
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == set(fields) and schema["additionalProperties"] is False
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    props = body["schema"]["properties"]
    assert props["echo"] == {"anyOf": [{"type": "boolean"}, {"type": "null"}]}
    assert [s.get("type") for s in props["prompt_logprobs"]["anyOf"]] == ["integer", "null"]
    assert body["examples"]["streamed"]["value"]["stream"] is True
    assert props["n"]["anyOf"][0]["maximum"] == LIMITS.max_n and props["model"]["enum"] == [MODEL]
    vocab = len(smollm2_tokenizer())
    assert props["prompt"]["anyOf"][2]["items"]["maximum"] == vocab - 1
    assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/v1/models"]["get"] and doc["paths"]["/metrics"]["get"]["security"] == []


def test_schemathesis_finds_no_5xx_and_no_response_outside_the_schema(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(FUZZ_CONFIG)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
           server.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}", "--checks", "all",
           "--exclude-checks", "positive_data_acceptance",  # valid by schema, yet past the context: a 400
           "--phases", "examples,coverage,fuzzing", "--max-examples", "12", "--workers", "1", "--no-color",
           "--output-truncate", "true", "--request-timeout", "60"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert "Tested: 7" in run.stdout and "No issues found" in run.stdout, report
    status, _, health = get_json(server, "/health")
    assert status == 200 and health == {"status": "ok"}
    code, _, r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Tell me", "max_tokens": 3,
                                                  "ignore_eos": True}, headers={"Authorization": f"Bearer {KEY}"})
    assert code == 200 and r["usage"]["completion_tokens"] == 3

    async def blocks_free() -> None:
        for _ in range(200):
            if server.opt.engine.kv.allocator.num_used == 0:
                return
            await asyncio.sleep(0.05)

    asyncio.run(blocks_free())
    assert server.opt.engine.kv.allocator.num_used == 0
