"""The engine's admission refusals in an HTTP user's words.

:class:`~devin_compile.runtime.admission.RequestRejected` speaks to a Python caller
(``SamplingParams.speculative``, ``max_new_tokens``, ``optimize(...)``). Someone holding only
curl cannot pass Python options: this says what the request asked for that this server cannot
do, in the request's own field names, and the way out (change the request, or restart the
server with a named ``devin-compile serve`` flag).
"""
from __future__ import annotations

from ..runtime.admission import RequestRejected
from .protocol import APIError, bad


def _no_speculation(f: dict, prompt: str) -> str:
    return ("this server runs without speculative decoding, so it cannot honour \"speculative\": leave the field "
            "out (or send false), or restart the server with --speculative ngram (or draft, head)")


def _no_kv_prune(f: dict, prompt: str) -> str:
    return ("this server's model was optimized without KV-cache pruning, so it cannot honour \"kv_prune\": leave "
            "the field out (or send false), or restart the server with --option 'kv_prune={\"threshold\": 0.05}'")


def _context_exceeded(f: dict, prompt: str) -> str:
    return (f"the {prompt} ({f['prompt']} tokens) + max_tokens ({f['new']}) = {f['prompt'] + f['new']} tokens, "
            f"over the model's context of {f['context']} tokens; lower max_tokens or shorten the {prompt}")


def _pool_exceeded(f: dict, prompt: str) -> str:
    return (f"the {prompt} ({f['prompt']} tokens) + max_tokens ({f['new']}) need {f['prompt'] + f['new']} "
            f"KV-cache slots but this server's whole KV cache holds {f['pool']}; lower max_tokens or shorten the "
            f"{prompt} (or restart the server with a larger --num-kv-blocks)")


_WORDING = {"no_speculation": _no_speculation, "no_kv_prune": _no_kv_prune,
            "context_exceeded": _context_exceeded, "pool_exceeded": _pool_exceeded}
_FIELD = {"max_new_tokens": "max_tokens", "params": None, "request_id": None}  # engine input → request field


def http_refusal(e: RequestRejected, prompt_field: str) -> APIError:
    """The 400 for ``e``: its ``param`` as the request field (``prompt_field``: ``"prompt"`` or
    ``"messages"``), its message reworded when the engine's speaks of Python options."""
    param = prompt_field if e.param == "prompt" else _FIELD.get(e.param, e.param)
    word = _WORDING.get(e.code)
    message = word(e.facts, prompt_field) if word is not None else str(e)
    if param is None:
        return APIError(400, message)
    return bad(param, message)
