"""The fields each request body may hold, as JSON Schema: the one list of names that
:mod:`.protocol` and :mod:`.tokenizer_endpoints` accept (any other field is a 400 naming it) and
that :mod:`.openapi` publishes as the request schemas.

A value is a schema, or a function of the served :class:`Facts` (model name, vocabulary, the
server's ``--max-n`` / ``--max-tokens-limit``) returning one. Each schema says what the server
accepts, no more: fields it cannot honour carry only their neutral value (``presence_penalty``: 0,
``tools``: []), as :func:`~devin_compile.serve.protocol.parse_request` checks them. Rules that span
fields (``top_logprobs`` needs ``logprobs``, ``stream_options`` needs ``stream``, ``best_of``
equals ``n``) are in the descriptions; the fuzzing test (tests/test_serve_openapi.py) checks that
a body this schema refuses is never accepted.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import KVPruneConfig, SpeculativeRequest
from ..runtime.logprobs import MAX_LOGPROBS
from ..text.chat_template import ROLES

MAX_STOP = 16
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # what torch.Generator.manual_seed takes, for seed + choice


@dataclass(frozen=True)
class Facts:
    """What a schema depends on in one server."""

    model: str
    vocab_size: int
    max_n: int = 16
    max_tokens: int = 4096


def _opt(schema: dict) -> dict:
    """``schema`` or null (the field left at its default)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo=None, hi=None) -> dict:
    return {"type": "integer", **({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}


_BOOL = _opt({"type": "boolean"})
_TOKEN_IDS = {"type": "array", "minItems": 1}  # "items": the vocabulary, filled in per server
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}}


def _ids(f: Facts) -> dict:
    return {**_TOKEN_IDS, "items": _int(0, f.vocab_size - 1)}


def _prompt(f: Facts) -> dict:
    text = {"type": "string", "minLength": 1}
    return {"description": "a string, a list of strings, token ids, or a list of token-id lists",
            "anyOf": [text, {"type": "array", "minItems": 1, "items": text}, _ids(f),
                      {"type": "array", "minItems": 1, "items": _ids(f)}]}


def _dataclass_object(cls, types: dict | None = None) -> dict:
    """An object of ``cls``'s fields (no others); ``types``: schemas of some of them."""
    return {"type": "object", "additionalProperties": False,
            "properties": {f.name: (types or {}).get(f.name, {}) for f in dataclasses.fields(cls)}}


_SPECULATIVE = {"description": "false: decode plainly; true or an object: speculate (a server started with "
                               "--speculative)",
                "anyOf": [{"type": ["boolean", "null"]}, _dataclass_object(SpeculativeRequest, {
                    "num_tokens": _opt(_int(1)), "adaptive": _BOOL,
                    "acceptance_threshold": _opt({"type": "number", "minimum": 0, "exclusiveMaximum": 1})})]}
_KV_PRUNE = {"description": "false, or KVPruneConfig fields (a model optimized with kv_prune=)",
             "anyOf": [{"enum": [False, None]}, _dataclass_object(KVPruneConfig)]}
_STOP = _opt({"anyOf": [{"type": "string", "minLength": 1},
                        {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}}]})

SHARED = {  # both generation endpoints
    "model": lambda f: {"type": "string", "enum": [f.model]},
    "n": lambda f: _opt(_int(1, f.max_n)),
    "temperature": _opt({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _opt({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _opt({**_int(-1), "description": "0 or -1: off"}),
    "seed": _opt(_int(*SEED_RANGE)),
    "stop": _STOP,
    "stream": _BOOL,
    "stream_options": _opt({"type": "object", "description": "only with stream: true",
                            "properties": {"include_usage": {"type": "boolean"}}}),
    "ignore_eos": _BOOL,
    "timeout": _opt({"type": "number", "exclusiveMinimum": 0, "description": "seconds; past it: 408"}),
    "speculative": _SPECULATIVE,
    "kv_prune": _KV_PRUNE,
    "user": _opt({"type": "string"}),
    # not supported: only the neutral value
    "presence_penalty": _opt({"const": 0}),
    "frequency_penalty": _opt({"const": 0}),
    "repetition_penalty": _opt({"const": 1}),
    "logit_bias": _opt({"type": "object", "maxProperties": 0}),
    "tools": _opt({"type": "array", "maxItems": 0}),
    "response_format": _opt({"type": "object", "required": ["type"], "additionalProperties": False,
                             "properties": {"type": {"const": "text"}}}),
}
COMPLETION = {
    **SHARED,
    "prompt": _prompt,
    "max_tokens": lambda f: _opt({**_int(0, f.max_tokens),
                                  "description": "0 only scores the prompt (echo with logprobs, or prompt_logprobs)"}),
    "logprobs": _opt(_int(0, MAX_LOGPROBS)),
    "echo": _BOOL,
    "prompt_logprobs": _opt(_int(0, MAX_LOGPROBS)),
    "suffix": _opt({"type": "string", "maxLength": 0}),
    "best_of": _opt({**_int(1), "description": "must equal n"}),
}
CHAT = {
    **SHARED,
    "messages": MESSAGES,
    "max_tokens": lambda f: _opt(_int(1, f.max_tokens)),
    "max_completion_tokens": lambda f: _opt(_int(1, f.max_tokens)),
    "logprobs": _BOOL,
    "top_logprobs": _opt({**_int(0, MAX_LOGPROBS), "description": "with logprobs: true"}),
    "prompt_logprobs": _opt({**_int(0, MAX_LOGPROBS), "description": "vLLM's: once on the response; not with stream"}),
    "echo": _opt({"const": False, "description": "completions only"}),
}


def _model_or_null(f: Facts) -> dict:
    """The tokenizer endpoints' ``model``: optional, as in vLLM."""
    return _opt(SHARED["model"](f))


TOKENIZE_PROMPT = {"model": _model_or_null, "prompt": {"type": "string"}, "add_special_tokens": _BOOL,
                   "return_token_strs": _BOOL}
TOKENIZE_CHAT = {"model": _model_or_null, "messages": MESSAGES, "add_generation_prompt": _BOOL,
                 "continue_final_message": _BOOL, "add_special_tokens": _BOOL, "return_token_strs": _BOOL}
DETOKENIZE = {"model": _model_or_null, "tokens": lambda f: {"type": "array", "items": _int(0, f.vocab_size - 1)}}
REQUIRED = {"completion": ["model", "prompt"], "chat": ["model", "messages"], "tokenize_prompt": ["prompt"],
            "tokenize_chat": ["messages"], "detokenize": ["tokens"]}


def body_schema(fields: dict, required: list[str], facts: Facts) -> dict:
    """The JSON Schema of a request body: ``fields`` as properties, no others."""
    props = {name: s(facts) if callable(s) else s for name, s in fields.items()}
    return {"type": "object", "required": required, "properties": props, "additionalProperties": False}
