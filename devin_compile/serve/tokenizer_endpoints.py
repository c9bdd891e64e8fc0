"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, for clients that count or check tokens.

- ``POST /tokenize`` with ``{"prompt": str, "add_special_tokens": true}`` or with
  ``{"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
  "add_special_tokens": false}`` (the tokenizer's chat template), and ``"return_token_strs"``
  → ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``: the tokenizer's token
  strings, or null unless asked for).
- ``POST /detokenize`` with ``{"tokens": [ids]}`` → ``{"prompt": text}``.

``model`` is optional in both, as in vLLM; when given it must name the served model (else 404).
Every field is checked by name (a 400 naming it), as the generation endpoints do.
"""
from __future__ import annotations

from ..text.chat_template import chat_prompt_ids, chat_prompt_text
from .protocol import bad, check_fields, check_model, opt_bool
from .request_fields import DETOKENIZE, TOKENIZE_CHAT, TOKENIZE_PROMPT


def tokenize(body: dict, tokenizer, served: str, max_model_len: int) -> dict:
    """The ``/tokenize`` answer for a parsed JSON ``body``."""
    chat = "messages" in body
    check_fields(body, TOKENIZE_CHAT if chat else TOKENIZE_PROMPT, "/tokenize with " +
                 ("messages" if chat else "a prompt"))
    check_model(body.get("model"), served)
    if chat:  # the template's text, tokenized with or without the tokenizer's special tokens
        template = dict(add_generation_prompt=opt_bool(body, "add_generation_prompt", True),
                        continue_final_message=opt_bool(body, "continue_final_message", False))
        special = opt_bool(body, "add_special_tokens", False)
        try:
            if special:
                ids = tokenizer(chat_prompt_text(tokenizer, body["messages"], **template))["input_ids"]
            else:
                ids = chat_prompt_ids(tokenizer, body["messages"], **template)
        except ValueError as e:
            raise bad("messages", str(e)) from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", f"prompt must be a string (or send messages), got {type(prompt).__name__}")
        ids = tokenizer(prompt, add_special_tokens=opt_bool(body, "add_special_tokens", True))["input_ids"]
    strs = tokenizer.convert_ids_to_tokens(ids) if opt_bool(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, tokenizer, served: str) -> dict:
    """The ``/detokenize`` answer for a parsed JSON ``body``."""
    check_fields(body, DETOKENIZE, "/detokenize")
    check_model(body.get("model"), served)
    tokens = body.get("tokens")
    vocab = len(tokenizer)
    if (not isinstance(tokens, list)
            or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in tokens)):
        raise bad("tokens", f"tokens must be a list of token ids in [0, {vocab})")
    return {"prompt": tokenizer.decode(tokens)}
