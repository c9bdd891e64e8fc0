"""How the quantization loops use the CPU's cores: one linear per worker thread, each single-threaded.

Pattern → replacement: a loop over linears whose every op (GPTQ's per-column updates on rows of a
few hundred floats, the clipping search's batched 64 x 64 products, the grid refit's small solves)
ran as an OpenMP parallel region over all of torch's intra-op threads → :func:`map_ordered`:
``workers`` Python threads, each taking whole linears with one intra-op thread.

Why: a parallel region ends at a barrier that waits for its slowest thread. On a 2-core machine
that other processes load, one of the two threads is often descheduled, so each of the ~10⁶ small
regions of a GPTQ run waited for a scheduler time slice while the other thread spun (user time
above what the work needs; issue 41: 747 s wall, 8m08s user on a loaded 2-core Xeon against 43 s
on a quiet EPYC). Measured on this project's loaded 2-core EPYC (load ~12), a 1536 x 576 and a
576 x 1536 linear: clipping search 24.6 s wall / GPTQ pass 30.2 s with 2 threads, 2.5 s / 0.5 s
with one. Whole linears per worker have no barrier between them; their ops release the GIL, so
the workers overlap on separate cores. Each linear's arithmetic is single-threaded either way, so
the results do not depend on the number of workers (tested).

``workers``: :func:`default_workers` — the cores this process may use (affinity and a cgroup CPU
quota), at most torch's intra-op thread count; ``DEVIN_COMPILE_QUANT_WORKERS`` overrides.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterable, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")
ENV = "DEVIN_COMPILE_QUANT_WORKERS"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def default_workers() -> int:
    env = os.environ.get(ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"{ENV}={env!r} must be a whole number of worker threads (1 or more)") from None
        if n < 1:
            raise ValueError(f"{ENV}={env!r} must be 1 or more")
        return n
    return max(1, min(usable_cores(), torch.get_num_threads()))


@contextmanager
def intra_op_threads(n: int):
    """torch's intra-op thread count set to ``n`` in this thread, restored after."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def map_ordered(fn: Callable[[T], R], items: Iterable[T], on_result: Callable[[int, T, R], None] | None = None,
                workers: int | None = None) -> list[R]:
    """``[fn(x) for x in items]``, each call single-threaded (module doc), on ``workers`` threads (one:
    the calling thread); ``on_result(i, item, result)`` runs in the calling thread as results come
    in, in order (progress). torch's thread count is restored before this returns."""
    items = list(items)
    workers = default_workers() if workers is None else workers
    out: list[R] = []

    def take(result: R) -> None:
        out.append(result)
        if on_result is not None:
            on_result(len(out) - 1, items[len(out) - 1], result)

    if workers <= 1 or len(items) <= 1:
        with intra_op_threads(1):
            for x in items:
                take(fn(x))
        return out

    def one(x: T) -> R:
        torch.set_num_threads(1)  # this worker thread's OpenMP team size (and MKL's, process-wide)
        return fn(x)

    prev = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="quant") as pool:
            futures = [pool.submit(one, x) for x in items]
            try:
                for f in futures:
                    take(f.result())
            finally:
                for f in futures:
                    f.cancel()
    finally:
        torch.set_num_threads(prev)
    return out
