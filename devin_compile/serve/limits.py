"""What one client may ask of the server: :class:`ServeLimits`, and :class:`BodyLimit`, the ASGI
middleware that refuses a request body over ``max_body_bytes`` with a 413.

The defaults are safe for a public port: a 1 MiB body, 8192 prompt tokens per request
(summed over its prompts), ``n`` up to 16, ``max_tokens`` up to 4096 (also the ceiling of
the default when a chat request leaves it out), 256 open connections (uvicorn's
``limit_concurrency``: a request on one connection more is answered 503). Each is a
``devin-compile serve`` flag, named in the 400 that enforces it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .protocol import APIError, GenerationRequest, bad


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-server limits (each a positive integer)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_n: int = 16
    max_tokens: int = 4096
    max_connections: int = 256

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_tokens", "max_n", "max_tokens", "max_connections"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServeLimits.{name} must be an integer >= 1, got {v!r}")

    def check(self, req: GenerationRequest, body: dict) -> None:
        """A 400 naming ``n`` or the ``max_tokens`` field the request sent (``body``: its JSON) when it
        asks for more than this server allows; a default it did not send is lowered to the limit."""
        if req.n > self.max_n:
            raise bad("n", f"n must be at most {self.max_n} on this server (--max-n), got {req.n}")
        if req.max_tokens is None or req.max_tokens <= self.max_tokens:
            return
        sent = next((f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None), None)
        if sent is None:  # completions' default of 16 on a server that allows fewer
            req.max_tokens = self.max_tokens
            return
        raise bad(sent, f"{sent} must be at most {self.max_tokens} on this server (--max-tokens-limit), "
                        f"got {req.max_tokens}")

    def check_prompt_tokens(self, total: int, field: str) -> None:
        """A 400 naming ``field`` once a request's prompts hold more than ``max_prompt_tokens`` tokens."""
        if total > self.max_prompt_tokens:
            raise bad(field, f"the request's {field} hold{'s' if field == 'prompt' else ''} more than "
                             f"{self.max_prompt_tokens} tokens, this server's limit per request "
                             "(--max-prompt-tokens); shorten it or split it across requests")


def body_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is over {max_bytes} bytes, this server's limit (--max-body-bytes); "
                         "send a smaller body", type="invalid_request_error", code="request_too_large")


class BodyLimit:
    """ASGI middleware: a body announced (``Content-Length``) or streamed past ``max_bytes`` makes the
    endpoint's read raise a 413 :class:`APIError` (answered, and counted, as the endpoint's error);
    nothing past the limit is buffered."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        announced = dict(scope["headers"]).get(b"content-length")
        over = announced is not None and announced.isdigit() and int(announced) > self.max_bytes
        seen = 0

        async def limited():
            nonlocal seen
            if over:
                raise body_too_large(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return message

        await self.app(scope, limited, send)
