"""A real ``redis-server`` for tests: started on a free 127.0.0.1 port with no persistence, stopped after.

No mock stands in for Redis: tests that claim Redis behaviour run against this server. The Debian
package ``redis-server`` provides it (``.ci/run`` installs it when missing). When it is absent the
``redis_server`` fixture skips locally, but fails when ``CI`` is set (so CI cannot pass by skipping).
Import the fixture into a test module: ``from redis_server import redis_server  # noqa: F401``.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        msg = "redis-server is not installed (apt-get install -y redis-server; .ci/run does this)"
        if in_ci():
            pytest.fail(msg + " and CI is set: Redis tests must run in CI")
        pytest.skip(msg)
    return exe


class RedisServer:
    """One redis-server process; ``start``/``stop``/``kill``/``restart`` keep the same port."""

    def __init__(self, exe: str, workdir: Path, port: int | None = None) -> None:
        self.exe, self.workdir, self.port = exe, workdir, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--dir", str(self.workdir), "--maxclients", "1000"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.admin().ping():
                    return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}; "
                                       f"see {self.workdir}/redis-{self.port}.log")
                time.sleep(0.02)

    def admin(self):
        """A plain redis-py client for the test itself (inspecting and tampering with keys)."""
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def kill(self) -> None:
        """SIGKILL: the server dies mid-run without a goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> "RedisServer":
        self.stop()
        return self.start()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test (empty, no persistence); stopped after it."""
    server = RedisServer(require_redis_server(), tmp_path).start()
    try:
        yield server
    finally:
        server.stop()
