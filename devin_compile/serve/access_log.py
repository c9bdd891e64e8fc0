"""One access-log line per request, written when its response ends (a stream: after its last
event), to the ``devin_compile.serve.access`` logger at INFO:

``127.0.0.1:50312 POST /v1/completions 200 tokens 12/16 0.153s``

client, method, path, the status sent, prompt/completion tokens (``-`` for requests that ran no
generation) and the latency from arrival to the response's end. A response that never ended (the
client went away, or the request was cancelled at shutdown) is logged as 499, one that raised as 500. Headers, bodies
and query strings are never logged (so neither is an API key). ``devin-compile serve`` prints
these lines on stderr; ``--no-access-log`` leaves the middleware out.
"""
from __future__ import annotations

import logging
import time

LOGGER = "devin_compile.serve.access"
log = logging.getLogger(LOGGER)


def _tokens(scope) -> str:
    """``in/out`` from the Generation the endpoint left in the request's state, or ``-``."""
    gen = scope.get("state", {}).get("generation")
    if gen is None:
        return "-"
    usage = gen.usage()
    return f"{usage['prompt_tokens']}/{usage['completion_tokens']}"


class AccessLog:
    """ASGI middleware writing the line above for every HTTP request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        sent = {"status": 499, "ended": False}

        async def watch(message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["ended"] = True
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, watch)
        except Exception:  # answered 500 by Starlette's outermost error middleware
            failed = True
            raise
        finally:
            status = sent["status"] if sent["ended"] else 500 if failed else 499
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            log.info("%s %s %s %d tokens %s %.3fs", where, scope["method"], scope["path"], status, _tokens(scope),
                     time.perf_counter() - start)
