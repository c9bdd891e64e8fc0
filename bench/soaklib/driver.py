"""The soak: the plan's requests against one server with at most ``concurrency`` in flight, in two
phases, faults fired part-way, resident memory sampled.

1. **Warm-up**: the first ``warmup`` requests; then, once the server is idle (no KV block held), the
   resident memory after warm-up is read.
2. **The rest**, with each :class:`Fault` fired (in a thread, while the other requests go on) once
   ``at`` requests of the whole plan have completed: e.g. Redis killed at half and restarted a little
   later. Once the server is idle again, the resident memory at the end is read.

Resident memory is also sampled every ``rss_every_s`` seconds throughout. The
whole soak is bounded by ``time_limit_s`` (``asyncio.TimeoutError`` past it: whatever is in flight is
cancelled, which closes its connection).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from .client import Outcome, run_item
from .observe import wait_idle
from .plan import Item


@dataclass
class Fault:
    """``action`` (blocking; run in a thread) once ``at`` requests have completed."""

    at: int
    name: str
    action: Callable[[], None]


@dataclass
class SoakRun:
    outcomes: list[Outcome]
    faults: list[dict]  # name, at (requests completed), t_s (since the start), took_s
    rss_after_warmup: int
    rss_end: int
    rss_series: list  # (seconds since the start, bytes) every rss_every_s
    idle_metrics: dict  # the /metrics scrape at the end, once idle
    wall_s: float
    warmup_s: float


class _Runner:
    def __init__(self, url: str, concurrency: int, faults: list[Fault], timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.sem = asyncio.Semaphore(concurrency)
        self.pending = sorted(faults, key=lambda f: f.at)
        self.fired: list[dict] = []
        self.completed = 0
        self.t0 = time.perf_counter()

    async def one(self, item: Item) -> Outcome:
        async with self.sem:
            out = await run_item(self.url, item, self.timeout_s)
        self.completed += 1
        while self.pending and self.completed >= self.pending[0].at:
            fault = self.pending.pop(0)  # popped before the await: fired once
            t = time.perf_counter()
            await asyncio.to_thread(fault.action)
            self.fired.append({"name": fault.name, "at": fault.at, "t_s": round(t - self.t0, 3),
                               "took_s": round(time.perf_counter() - t, 3)})
        return out

    async def batch(self, items: list[Item]) -> list[Outcome]:
        return list(await asyncio.gather(*(self.one(it) for it in items)))


async def _sample(rss: Callable[[], int], series: list, t0: float, every_s: float) -> None:
    while True:
        series.append((round(time.perf_counter() - t0, 2), rss()))
        await asyncio.sleep(every_s)


async def _phases(runner: _Runner, plan: list[Item], warmup: int, rss: Callable[[], int]) -> tuple:
    warm = await runner.batch(plan[:warmup])
    await wait_idle(runner.url)
    warmup_s, rss_warm = time.perf_counter() - runner.t0, rss()
    rest = await runner.batch(plan[warmup:])
    metrics = await wait_idle(runner.url)
    return warm + rest, warmup_s, rss_warm, rss(), metrics


async def soak(url: str, plan: list[Item], *, concurrency: int, warmup: int, faults: list[Fault],
               rss: Callable[[], int], time_limit_s: float, rss_every_s: float = 1.0,
               request_timeout_s: float = 600.0) -> SoakRun:
    """Run ``plan`` against the server at ``url`` (``rss()``: its resident memory in bytes)."""
    runner = _Runner(url, concurrency, faults, request_timeout_s)
    series: list = []
    sampler = asyncio.create_task(_sample(rss, series, runner.t0, rss_every_s))
    try:
        outcomes, warmup_s, rss_warm, rss_end, metrics = await asyncio.wait_for(
            _phases(runner, plan, warmup, rss), time_limit_s)
    finally:
        sampler.cancel()
    return SoakRun(outcomes, runner.fired, rss_warm, rss_end, series, metrics, time.perf_counter() - runner.t0,
                   warmup_s)
