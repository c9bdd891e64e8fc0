"""API keys: ``Authorization: Bearer KEY`` on every request but the open paths, checked by
Starlette's ``AuthenticationMiddleware`` with :class:`BearerKeys` as its backend.

Open without a key: ``/health``, ``/openapi.json`` and (unless ``metrics_auth``) ``/metrics``;
everything else, every ``/v1/*`` path, ``/tokenize`` and ``/detokenize`` included, answers 401
in OpenAI's error shape without one of the keys. Keys are kept only as SHA-256 digests and
compared with :func:`hmac.compare_digest` against every key (no early exit), so neither the
time taken nor the key's length tells a caller how close a guess was. A key is never logged,
echoed in an error or kept in plain text.
"""
from __future__ import annotations

import hashlib
import hmac
import os

from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.responses import JSONResponse

from .protocol import APIError

ENV_KEY = "DEVIN_API_KEY"
OPEN_PATHS = frozenset({"/health", "/openapi.json"})


def check_key(key: str) -> str:
    """``key`` if it can travel in an HTTP header (printable ASCII, no spaces), else ValueError;
    the message never repeats the key."""
    if not key or not all(33 <= ord(c) < 127 for c in key):
        raise ValueError("an API key must be non-empty printable ASCII without spaces (it travels in the "
                         "Authorization header)")
    return key


def keys_from(flags: list[str] | None, environ=os.environ) -> list[str]:
    """The ``--api-key`` values, else the ``DEVIN_API_KEY`` variable, else none."""
    if flags:
        return [check_key(k) for k in flags]
    env = environ.get(ENV_KEY)
    return [check_key(env)] if env else []


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class BearerKeys(AuthenticationBackend):
    """The authentication backend: the request's bearer token against every key."""

    def __init__(self, keys, metrics_auth: bool = False) -> None:
        self._digests = [_digest(check_key(k).encode()) for k in keys]
        if not self._digests:
            raise ValueError("BearerKeys needs at least one key")
        self.open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}

    def __repr__(self) -> str:
        return f"BearerKeys({len(self._digests)} keys)"

    def matches(self, token: bytes) -> bool:
        """True when ``token`` is one of the keys; constant time over all of them."""
        given = _digest(token)
        found = False
        for d in self._digests:
            found |= hmac.compare_digest(d, given)
        return found

    async def authenticate(self, conn):
        if conn.url.path in self.open_paths:
            return None
        header = conn.headers.get("authorization")
        if header is None:
            raise AuthenticationError("no API key: send the header 'Authorization: Bearer KEY' with one of the "
                                      "server's keys (--api-key or DEVIN_API_KEY)")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not self.matches(token.strip().encode("latin-1")):
            raise AuthenticationError("invalid API key: send the header 'Authorization: Bearer KEY' with one of the "
                                      "server's keys (--api-key or DEVIN_API_KEY)")
        return AuthCredentials(["api"]), SimpleUser("api-key")


def unauthorized(conn, exc: AuthenticationError) -> JSONResponse:
    """The 401 as OpenAI answers it, with ``WWW-Authenticate: Bearer``."""
    e = APIError(401, str(exc), code="invalid_api_key")
    return JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
