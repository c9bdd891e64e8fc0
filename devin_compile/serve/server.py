"""Running the app: :func:`serve` (foreground, SIGTERM/SIGINT shut it down gracefully) and
:class:`BackgroundServer` (a thread, for tests, benchmarks and notebooks).

uvicorn serves the Starlette app, with at most ``max_connections`` open connections at once
(uvicorn's ``limit_concurrency``: a request on one more is answered 503). On SIGTERM it stops
accepting connections, lets the requests in flight finish for up to ``shutdown_timeout`` seconds, then cancels the rest
(each aborts its engine request); the app's lifespan closes the engine thread, and
:func:`serve` returns normally (the CLI exits 0).
"""
from __future__ import annotations

import ipaddress
import signal
import socket
import threading
import time

import uvicorn

from .app import Server


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (``port=0``: an ephemeral one; read it back with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, has_key: bool) -> str | None:
    """The warning to print when the server listens beyond loopback without an API key (else None)."""
    if has_key or is_loopback(host):
        return None
    return (f"warning: listening on {host} without an API key: anyone who can reach this port can run the model; "
            "set --api-key KEY (or DEVIN_API_KEY), or listen on --host 127.0.0.1")


def _config(server: Server, shutdown_timeout: float, log_level: str) -> uvicorn.Config:
    # uvicorn answers 503 once its open connections reach limit_concurrency, this one included: + 1
    # lets max_connections connections be served at once
    return uvicorn.Config(server.app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                          access_log=False, lifespan="on", timeout_keep_alive=30,
                          limit_concurrency=server.limits.max_connections + 1)


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000, *, shutdown_timeout: float = 30.0,
          log_level: str = "warning", on_ready=None) -> None:
    """Serve until SIGTERM / SIGINT; ``on_ready(url)`` is called once the socket listens."""
    sock = bind(host, port)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    uv = uvicorn.Server(_config(server, shutdown_timeout, log_level))
    if on_ready is not None:
        _call_when_started(uv, lambda: on_ready(url))
    # uvicorn handles SIGTERM/SIGINT while it runs, then re-raises the signal into the handlers it found
    # installed: make those no-ops, so a graceful shutdown ends the process normally (exit 0)
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        uv.run(sockets=[sock])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _ignore(sig, frame) -> None:
    pass


def _call_when_started(uv: uvicorn.Server, fn) -> None:
    startup = uv.startup

    async def wrapped(sockets=None):
        await startup(sockets=sockets)
        if uv.started:
            fn()

    uv.startup = wrapped


class BackgroundServer:
    """``with BackgroundServer(Server(opt)) as s: OpenAI(base_url=s.url + "/v1")`` on 127.0.0.1 and an
    ephemeral port; leaving the block shuts it down (graceful, ``shutdown_timeout``)."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                 startup_timeout: float = 60.0) -> None:
        self.server = server
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.uv = uvicorn.Server(_config(server, shutdown_timeout, "warning"))
        self.startup_timeout = startup_timeout
        self.thread: threading.Thread | None = None

    def __enter__(self) -> "BackgroundServer":
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, name="devin-serve",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.uv.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()
