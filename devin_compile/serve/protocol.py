"""OpenAI request bodies → checked :class:`GenerationRequest`; OpenAI-style errors.

Every field is checked by name and type before anything is queued; a bad one is an
:class:`APIError` (400 unless said otherwise) whose ``param`` names it, e.g.
``{"error": {"message": "max_tokens must be an integer >= 1, got -3", "type":
"invalid_request_error", "param": "max_tokens", "code": null}}``. The fields an endpoint takes
are those :mod:`.request_fields` lists for it (also its published schema); any other is a 400
naming it. Options the engine cannot honour (penalties, ``logit_bias``, ``best_of`` > n,
``suffix``, ``echo`` on chat) are refused as not supported rather than ignored. Logprobs:
completions ``logprobs: k`` (0..20), chat ``logprobs: true`` with ``top_logprobs: k``. Completions
``echo: true`` returns the prompt before the completion (with ``logprobs``, the prompt tokens'
logprobs too, the first null); ``max_tokens: 0`` is allowed only when the prompt is scored (``echo``
with ``logprobs``, or ``prompt_logprobs``). devin-compile's own options ride in the body as extra
fields, as vLLM does: ``prompt_logprobs: k`` (vLLM's per-position dicts; not with ``stream``),
``kv_prune`` (false or a KVPruneConfig dict), ``speculative`` (false, true or ``{"num_tokens",
"acceptance_threshold", "adaptive"}``), ``ignore_eos``, ``top_k`` and ``timeout`` (seconds for this
request).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import KVPruneConfig, SpeculativeRequest
from ..validation import from_mapping
from ..runtime.logprobs import MAX_LOGPROBS
from .request_fields import CHAT, COMPLETION, MAX_STOP, SEED_RANGE


class APIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` and ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _opt_int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"{name} must be an integer {rng}, got {v!r}")
    return v


def _opt_num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def check_fields(body: dict, allowed, what: str) -> None:
    """A 400 naming the first field of ``body`` that ``allowed`` (names) does not hold."""
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad(unknown[0], f"{what} does not take {unknown[0]!r}; it takes {sorted(allowed)} (GET /openapi.json)")


def check_model(model: str | None, served: str) -> None:
    """404 as OpenAI answers it unless ``model`` (None: not given) is the served one."""
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{served}` (GET /v1/models)",
                       param="model", code="model_not_found")


def opt_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


@dataclass
class GenerationRequest:
    """One checked /v1/completions or /v1/chat/completions body."""

    model: str
    prompts: list  # list of (str | list[int]) for completions; [messages] for chat
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    kv_prune: Any = None
    speculative: Any = None  # None | bool | SpeculativeRequest
    logprobs: int | None = None  # top alternatives per token (None: no logprobs)
    timeout: float | None = None
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    prompt_logprobs: int | None = None  # vLLM's extra field: top alternatives per prompt token

    @property
    def scored_prompt(self) -> int | None:
        """Alternatives per prompt token the engine computes (None: the prompt is not scored)."""
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(ks) if ks else None

    def sampling_kwargs(self, choice: int) -> dict:
        """``SamplingParams`` fields for choice ``choice`` (seeded choices get seed + choice)."""
        sample = self.temperature > 0
        return dict(do_sample=sample, temperature=self.temperature if sample else 1.0, top_p=self.top_p,
                    top_k=self.top_k, seed=None if self.seed is None else self.seed + choice,
                    ignore_eos=self.ignore_eos, kv_prune=self.kv_prune, speculative=self.speculative,
                    logprobs=self.logprobs, prompt_logprobs=self.scored_prompt)


_UNSUPPORTED_HINT = {"response_format": " (only {\"type\": \"text\"})", "tools": " (no tool calls)",
                     "suffix": " (no insertion)"}


def _unsupported(body: dict, chat: bool) -> None:
    if chat and body.get("echo") not in (None, False):
        raise bad("echo", "echo is only for /v1/completions (it returns the prompt before the completion); "
                          "leave it out of chat requests")
    checks = [  # refused unless None or the neutral value, compared with its JSON type (false is not 0)
        ("suffix", lambda v: v not in (None, "")),
        ("presence_penalty", lambda v: v is not None and not (_is_num(v) and v == 0)),
        ("frequency_penalty", lambda v: v is not None and not (_is_num(v) and v == 0)),
        ("repetition_penalty", lambda v: v is not None and not (_is_num(v) and v == 1)),
        ("logit_bias", lambda v: v not in (None, {})),
        ("tools", lambda v: v not in (None, [])),
        ("response_format", lambda v: v not in (None, {"type": "text"})),
    ]
    fields = CHAT if chat else COMPLETION  # a field the endpoint does not take was refused already
    for name, refused in checks:
        if name in fields and name in body and refused(body[name]):
            raise bad(name, f"this server does not support {name}{_UNSUPPORTED_HINT.get(name, '')}; leave it out")
    if chat:
        return
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and not (_is_int(best_of) and best_of == (1 if n is None else n)):
        raise bad("best_of", "this server does not support best_of other than n (it returns every choice); "
                             "use n instead")


def _prompts(body: dict) -> list:
    if "prompt" not in body:
        raise bad("prompt", "prompt is required: a string, a list of strings, or token ids")
    p = body["prompt"]
    if isinstance(p, str):
        prompts = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
        prompts = list(p)
    else:
        raise bad("prompt", "prompt must be a non-empty string, a list of strings, a list of token ids, "
                            "or a list of token-id lists")
    if any(isinstance(x, str) and not x for x in prompts):
        raise bad("prompt", "prompt must not be empty")
    return prompts


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or len(s) > MAX_STOP or not all(isinstance(x, str) and x for x in s):
        raise bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, "
                          f"got {body.get('stop')!r}")
    return s


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions ``logprobs: k``; chat ``logprobs: true`` (+ ``top_logprobs: k``) → k, or None."""
    if not chat:
        return _opt_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    on = opt_bool(body, "logprobs", False)
    top = _opt_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not on:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if on else None


def _speculative(body: dict):
    """The ``speculative`` extra field: None, false, true or an object of SpeculativeRequest fields."""
    v = body.get("speculative")
    if v is not None and not isinstance(v, (bool, dict)):
        raise bad("speculative", "speculative must be false, true or an object like {\"num_tokens\": 4, "
                                 f"\"acceptance_threshold\": 0.3}}, got {v!r}")
    try:
        return from_mapping(SpeculativeRequest, v, "speculative") if isinstance(v, dict) else v
    except (ValueError, TypeError) as e:
        raise bad("speculative", str(e)) from None


def _kv_prune(body: dict):
    """The ``kv_prune`` extra field: None, false or an object of KVPruneConfig fields (validated)."""
    v = body.get("kv_prune")
    if v is None or v is False:
        return v
    if not isinstance(v, dict):
        raise bad("kv_prune", "kv_prune must be false or an object of KVPruneConfig fields")
    try:
        return KVPruneConfig.coerce(v, "kv_prune")
    except ValueError as e:
        raise bad("kv_prune", str(e)) from None


def _required_or_wrong(body: dict, name: str, what: str) -> str:
    """The message for a field that must be ``what``: missing (null counts as missing), or sent wrong."""
    if body.get(name) is None:
        return f"{name} is required: {what}"
    return f"{name} must be {what}, got {json.dumps(body[name])[:80]}"


def parse_request(body: dict, chat: bool) -> GenerationRequest:
    check_fields(body, CHAT if chat else COMPLETION, "/v1/chat/completions" if chat else "/v1/completions")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", _required_or_wrong(body, "model", "a string naming the model (see GET /v1/models)"))
    _unsupported(body, chat)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", f"user must be a string (an id of your end user), got {body['user']!r}")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("messages", _required_or_wrong(body, "messages", "a non-empty list of {'role', 'content'} "
                                                                        "objects"))
        prompts = [msgs]
        given = _opt_int(body, "max_tokens", None, 1)  # both checked; max_completion_tokens wins
        max_tokens = _opt_int(body, "max_completion_tokens", given, 1)
    else:
        prompts = _prompts(body)
        max_tokens = _opt_int(body, "max_tokens", 16, 0)
    so = body.get("stream_options")
    if so is not None and not (isinstance(so, dict) and isinstance(so.get("include_usage", False), bool)):
        raise bad("stream_options", "stream_options must be an object like {'include_usage': true}")
    stream = opt_bool(body, "stream", False)
    if so is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    kv_prune = _kv_prune(body)
    timeout = body.get("timeout")
    if timeout is not None and (not _is_num(timeout) or timeout <= 0):
        raise bad("timeout", f"timeout must be a number of seconds > 0, got {timeout!r}")
    seed = _opt_int(body, "seed", None, *SEED_RANGE)
    req = GenerationRequest(
        model=model, prompts=prompts, max_tokens=max_tokens,
        temperature=_opt_num(body, "temperature", 1.0, 0.0, 2.0), top_p=_opt_num(body, "top_p", 1.0, 0.0, 1.0, True),
        top_k=_opt_int(body, "top_k", 0, -1), seed=seed, stop=_stop(body), n=_opt_int(body, "n", 1, 1),
        stream=stream, include_usage=bool(so and so.get("include_usage")),
        ignore_eos=opt_bool(body, "ignore_eos", False), kv_prune=kv_prune, speculative=_speculative(body),
        logprobs=_logprobs(body, chat), timeout=None if timeout is None else float(timeout),
        echo=opt_bool(body, "echo", False), prompt_logprobs=_opt_int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS))
    req.top_k = max(req.top_k, 0)  # vLLM's -1 (off) is 0 here
    _check_scoring(req)
    return req


def _check_scoring(req: GenerationRequest) -> None:
    """``max_tokens: 0`` only scores a prompt; ``prompt_logprobs`` comes whole, never streamed (as in vLLM)."""
    if req.max_tokens == 0 and req.scored_prompt is None:
        raise bad("max_tokens", "max_tokens must be an integer >= 1, got 0 (0 only scores the prompt: send echo: "
                                "true with logprobs, or prompt_logprobs)")
    if req.prompt_logprobs is not None and req.stream:
        raise bad("prompt_logprobs", "prompt_logprobs is not available with stream: true; send the request "
                                     "unstreamed (or use echo: true with logprobs, which streams)")
