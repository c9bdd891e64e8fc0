"""Malformed request bodies and the answer each must get: bad JSON, wrong types, unknown fields,
out-of-range values, an unknown model, a body past the server's ``--max-body-bytes``.

Each maker takes a valid body (a dict), whether it is a chat body, and the server's body limit, and
returns ``(raw bytes, expected status, expected param or None)``.
"""
from __future__ import annotations

import json


def _dump(body: dict) -> bytes:
    return json.dumps(body).encode()


def bad_json(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    return _dump(body)[:-3], 400, None  # cut short: not JSON


def not_an_object(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    return json.dumps([body]).encode(), 400, None


def wrong_type(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    return _dump({**body, "max_tokens": "ten"}), 400, "max_tokens"


def wrong_prompt_type(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    field = "messages" if chat else "prompt"
    return _dump({**body, field: {"text": "a mapping is not a prompt"}}), 400, field


def unknown_field(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    return _dump({**body, "frobnicate": True}), 400, "frobnicate"


def out_of_range(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    return _dump({**body, "temperature": -1}), 400, "temperature"


def unknown_model(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    return _dump({**body, "model": "no-such-model"}), 404, "model"


def oversized(body: dict, chat: bool, max_body: int) -> tuple[bytes, int, str | None]:
    filler = "x" * (max_body + 1)
    big = {**body, "messages": [{"role": "user", "content": filler}]} if chat else {**body, "prompt": filler}
    return _dump(big), 413, None


MAKERS = [bad_json, not_an_object, wrong_type, wrong_prompt_type, unknown_field, out_of_range, unknown_model,
          oversized]
