"""``GET /openapi.json``: the OpenAPI 3.1 document of this server, built per server.

Request schemas come from :mod:`.request_fields` (the names the endpoints accept) filled in with
the served model, vocabulary and limits; response schemas say what each endpoint answers, every
error in OpenAI's shape. With API keys, a bearer security scheme covers every operation but the
open ones (``/health``, ``/openapi.json``, and ``/metrics`` unless ``metrics_auth``).
"""
from __future__ import annotations

from importlib import metadata

from . import request_fields as rf

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_INT = {"type": "integer"}
_FINISH = {"enum": ["stop", "length", "abort", "error", None]}
_LOGPROBS = {"type": ["object", "null"]}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT}}


def _answer(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": obj}, "created": _INT, "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object", "required": list(choice), "properties": choice}},
        "usage": USAGE}}


COMPLETION = _answer("text_completion", {"index": _INT, "text": {"type": "string"}, "logprobs": _LOGPROBS,
                                         "finish_reason": _FINISH})
CHAT = _answer("chat.completion", {"index": _INT, "logprobs": _LOGPROBS, "finish_reason": _FINISH, "message": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}})
DELTA = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}


def _chunk(obj: str, choice: dict) -> dict:
    """A streamed chunk; ``usage`` is null but in the last when stream_options.include_usage."""
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": obj}, "created": _INT, "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object", "required": list(choice), "properties": choice}},
        "usage": {"anyOf": [USAGE, {"type": "null"}]}}}


def _events(chunk: dict) -> dict:
    """One server-sent event: a JSON chunk (or an error once streaming has begun), or [DONE]."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [chunk, ERROR]}}]}}}


COMPLETION_EVENT = _events(_chunk("text_completion", {"index": _INT, "text": {"type": "string"},
                                                      "logprobs": _LOGPROBS, "finish_reason": _FINISH}))
CHAT_EVENT = _events(_chunk("chat.completion.chunk", {"index": _INT, "delta": DELTA, "logprobs": _LOGPROBS,
                                                      "finish_reason": _FINISH}))
MODELS = {"type": "object", "required": ["object", "data"], "properties": {"object": {"const": "list"}, "data": {
    "type": "array", "items": {"type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
                               "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                              "created": _INT, "owned_by": {"type": "string"},
                                              "max_model_len": _INT}}}}}
TOKENIZED = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
    "count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
    "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}}}
DETOKENIZED = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
HEALTH = {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
UNHEALTHY = {"type": "object", "required": ["status", "error"],
             "properties": {"status": {"const": "error"}, "error": {"type": "string"}}}

_HI = [{"role": "user", "content": "Hi"}]
_WHY = {400: "a field is invalid (named in error.param)", 401: "no valid API key (Authorization: Bearer KEY)",
        404: "an unknown model, path, or metrics turned off", 405: "a method the path does not take",
        408: "the request ran past its timeout", 413: "the body is over --max-body-bytes",
        429: "the queue is full (--max-queue); see Retry-After",
        503: "more open connections than --max-connections (plain text, from uvicorn)"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    out = {str(c): _json({"$ref": "#/components/schemas/Error"}, _WHY[c]) for c in codes}
    out["503"] = {"description": _WHY[503], "content": {"text/plain": {"schema": {"type": "string"}}}}
    return out


def _post(summary: str, body: dict, examples: dict, ok: dict, errors: tuple[int, ...]) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": body, "examples": {k: {"value": v} for k, v in examples.items()}}}},
        "responses": {**ok, **_errors(*errors)}}}


def _generation(fields: dict, required: list, answer: tuple, facts: rf.Facts, what: str, errs) -> dict:
    ok = {"200": {"description": f"the {what}; with stream: true, server-sent events ending in data: [DONE]",
                  "content": {"application/json": {"schema": answer[0]},
                              "text/event-stream": {"schema": answer[1]}}}}
    first = {"model": facts.model, "max_tokens": min(4, facts.max_tokens),
             **({"messages": _HI} if "messages" in required else {"prompt": "Once upon a time"})}
    examples = {"plain": first, "streamed": {**first, "stream": True, "stream_options": {"include_usage": True}}}
    return _post(f"OpenAI {what}", rf.body_schema(fields, required, facts), examples, ok, errs + (408, 429))


def _paths(facts: rf.Facts, auth: bool, metrics_auth: bool) -> dict:
    guard = (401,) if auth else ()
    errs = (400, *guard, 404, 405, 413)
    tokenize = {"anyOf": [rf.body_schema(rf.TOKENIZE_PROMPT, rf.REQUIRED["tokenize_prompt"], facts),
                          rf.body_schema(rf.TOKENIZE_CHAT, rf.REQUIRED["tokenize_chat"], facts)]}
    open_ = {"security": []} if auth else {}
    metrics_open = {} if metrics_auth else open_
    return {
        "/v1/completions": _generation(rf.COMPLETION, rf.REQUIRED["completion"], (COMPLETION, COMPLETION_EVENT),
                                       facts, "completion", errs),
        "/v1/chat/completions": _generation(rf.CHAT, rf.REQUIRED["chat"], (CHAT, CHAT_EVENT), facts,
                                            "chat completion", errs),
        "/v1/models": {"get": {"summary": "the served model", "responses": {
            "200": _json(MODELS, "the model list"), **_errors(*guard, 405)}}},
        "/tokenize": _post("token ids of a prompt or of chat messages (vLLM's shape)", tokenize,
                           {"prompt": {"prompt": "Hello"}, "chat": {"messages": _HI, "return_token_strs": True}},
                           {"200": _json(TOKENIZED, "the tokens")}, errs),
        "/detokenize": _post("text of token ids (vLLM's shape)",
                             rf.body_schema(rf.DETOKENIZE, rf.REQUIRED["detokenize"], facts),
                             {"ids": {"tokens": list(range(min(3, facts.vocab_size)))}},
                             {"200": _json(DETOKENIZED, "the text")}, errs),
        "/health": {"get": {"summary": "liveness", **open_, "responses": {
            "200": _json(HEALTH, "serving"), **_errors(405), "503": {
                "description": "the engine failed, or " + _WHY[503], "content": {
                    "application/json": {"schema": UNHEALTHY}, "text/plain": {"schema": {"type": "string"}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", **metrics_open, "responses": {
            "200": {"description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors(*((401,) if metrics_auth else ()), 404, 405)}}},
        "/openapi.json": {"get": {"summary": "this document", **open_, "responses": {
            "200": _json({"type": "object"}, "OpenAPI 3.1"), **_errors(405)}}},
    }


def openapi_document(facts: rf.Facts, *, auth: bool = False, metrics_auth: bool = False) -> dict:
    """The OpenAPI 3.1 document of a server with these ``facts``."""
    try:
        version = metadata.version("devin-compile")
    except metadata.PackageNotFoundError:
        version = "unknown"
    doc = {"openapi": "3.1.0",
           "info": {"title": f"devin-compile serving {facts.model}", "version": version,
                    "description": "OpenAI-compatible completions and chat, vLLM's tokenizer endpoints, health "
                                   "and Prometheus metrics. Errors: {\"error\": {message, type, param, code}}."},
           "paths": _paths(facts, auth, metrics_auth),
           "components": {"schemas": {"Error": ERROR}}}
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
