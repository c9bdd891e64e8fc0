"""``--tensor-parallel N`` without torchrun: the CLI launches its ranks itself, torchrun style.

:func:`spawn_ranks` starts N copies of the same ``devin-compile`` command line (``python -m
devin_compile.cli ...``) with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT: a free port; env:// rendezvous), each with ``cpus / N`` threads
unless OMP_NUM_THREADS says otherwise, and supervises them:

- a rank that exits with an error (or is killed) stops the others: the launcher prints which rank
  and how it ended, sends them SIGTERM, then SIGKILL after ``grace_s``, and exits 1;
- rank 0 ending normally (the server stopped, the prompts answered) lets the others finish (rank 0
  tells them to), killing any still alive after ``grace_s``;
- SIGTERM or Ctrl-C on the launcher goes to rank 0 as SIGTERM (a graceful stop: it tells the
  other ranks), then to every rank left after ``stop_s``;
- every rank gets SIGKILL when the launcher itself dies (Linux ``PR_SET_PDEATHSIG``).

No process outlives the launcher. Under torchrun (RANK set) the CLI runs as that rank instead.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

#: torchrun's variables; a command run with them is one rank of a launched group
RANK_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether this process is one rank of a group (torchrun's or :func:`spawn_ranks`'s environment)."""
    return all(k in os.environ for k in RANK_ENV)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the child, before exec: SIGKILL when the launcher dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_env(rank: int, world: int, port: int, environ=os.environ) -> dict:
    threads = environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
    return {**environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": threads}


def spawn_ranks(argv: list[str], world: int, *, stop_s: float = 40.0, grace_s: float = 10.0) -> int:
    """Run ``devin-compile argv`` as ``world`` ranks on this machine; the launcher's exit status."""
    port = free_port()
    cmd = [sys.executable, "-m", "devin_compile.cli", *argv]
    procs = [subprocess.Popen(cmd, env=rank_env(r, world, port), preexec_fn=_die_with_parent)
             for r in range(world)]
    stopping: list[float] = []

    def stop(sig, frame) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            _signal(procs[0], signal.SIGTERM)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(procs, stopping, stop_s, grace_s)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        _stop_all(procs, grace_s)


def _supervise(procs: list[subprocess.Popen], stopping: list[float], stop_s: float, grace_s: float) -> int:
    rank0_done: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r, c = failed[0]
            how = f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with status {c}"
            print(f"devin-compile: error: tensor-parallel rank {r} {how}; stopping the other ranks",
                  file=sys.stderr, flush=True)
            return 1
        if all(c is not None for c in codes):
            return 0
        now = time.monotonic()
        if codes[0] == 0:  # rank 0 is done and has told the others: they follow it out
            rank0_done = rank0_done or now
            if now - rank0_done > grace_s:
                left = [r for r, c in enumerate(codes) if c is None]
                print(f"devin-compile: warning: rank(s) {left} still running {grace_s:.0f} s after rank 0 ended; "
                      "killing them", file=sys.stderr, flush=True)
                return 0
        if stopping and now - stopping[0] > stop_s:
            print(f"devin-compile: error: the ranks did not stop within {stop_s:.0f} s of the signal; killing them",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(0.1)


def _signal(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every rank still alive, SIGKILL after ``grace_s``; reap them all."""
    for p in procs:
        _signal(p, signal.SIGTERM)
        _signal(p, signal.SIGCONT)  # a stopped (hung) rank takes the SIGTERM now
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
