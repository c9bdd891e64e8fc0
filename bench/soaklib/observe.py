"""What the soak reads off the server besides its answers: ``/metrics`` samples, whether it is idle
(no request queued or running, no KV block held), ``/health``, and a process's resident memory."""
from __future__ import annotations

import asyncio

from .wire import get


async def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {sample name with its labels: value}."""
    status, body = await get(url, "/metrics")
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def idle(m: dict[str, float]) -> bool:
    return m["devin_kv_blocks_used"] == 0 and m["devin_running_sequences"] == 0 and m["devin_queue_requests"] == 0


async def wait_idle(url: str, limit_s: float = 60.0) -> dict[str, float]:
    """The first ``/metrics`` scrape that shows the server idle (cut-off requests are aborted a moment
    after their client leaves), or the last one after ``limit_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while True:
        m = await scrape(url)
        if idle(m) or loop.time() > deadline:
            return m
        await asyncio.sleep(0.1)


async def health(url: str) -> int:
    return (await get(url, "/health"))[0]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of process ``pid`` (``VmRSS`` in ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def status_counts(m: dict[str, float]) -> dict[str, int]:
    """``devin_requests_total`` summed over endpoints, by HTTP status."""
    out: dict[str, int] = {}
    for name, v in m.items():
        if name.startswith("devin_requests_total{"):
            status = name.split('status="', 1)[1].split('"', 1)[0]
            out[status] = out.get(status, 0) + int(v)
    return dict(sorted(out.items()))

