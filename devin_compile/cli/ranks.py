"""``--tensor-parallel N`` for ``run`` and ``serve``: launch the ranks, or be one of them.

Without torchrun's environment the command relaunches itself as N ranks (:mod:`.launch`) and
supervises them. As a rank (launched so, or by ``torchrun --nproc-per-node N -m devin_compile.cli
...``) it joins the process group from env:// (gloo on CPU, NCCL on CUDA; every collective bounded
by ``--tp-timeout``), optimizes its shard (``tensor_parallel=N``), and then rank 0 does the work
(answers the prompts, serves HTTP) while the other ranks follow its step plans; those print nothing
and leave Ctrl-C to rank 0 (it tells them when it is done), SIGTERM still ends them.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from . import common
from .launch import launched, spawn_ranks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", type=common.int_at_least(1), default=1, metavar="N",
                   help="split the model over N processes (ranks) on this machine, spawned by this command, or "
                        "the ranks torchrun started (torchrun --nproc-per-node N -m devin_compile.cli ...); rank 0 "
                        "does the work, the others follow its steps (default 1)")
    p.add_argument("--tp-timeout", type=common.positive_float, default=120.0, metavar="S",
                   help="with --tensor-parallel: a rank that does not answer a collective within S seconds is "
                        "lost, and every rank stops with an error (default 120)")


def launch(args, stop_s: float = 40.0) -> int | None:
    """The launcher's exit status after running this command as ``--tensor-parallel`` ranks, or None
    when there is nothing to launch (N = 1, or this process already is a rank)."""
    if args.tensor_parallel == 1 or launched():
        return None
    return spawn_ranks(args.argv, args.tensor_parallel, stop_s=stop_s)


def join(args, device: str | None = None):
    """As a rank: the process group (initialised with ``--tp-timeout``; NCCL when ``device`` is CUDA, else
    gloo); None with N = 1."""
    tp = args.tensor_parallel
    world = int(os.environ["WORLD_SIZE"]) if launched() else None
    if tp == 1:
        if world not in (None, 1):  # every rank would run the whole command (and bind the same port)
            raise ValueError(f"launched as {world} processes (torchrun) without --tensor-parallel: give "
                             f"--tensor-parallel {world}")
        return None
    if world != tp:
        raise ValueError(f"--tensor-parallel {tp}, but torchrun started {world} processes; give "
                         f"--nproc-per-node {tp}")
    import torch

    from ..runtime.distributed import init_rank_group

    kind = "cuda" if str(device or "cpu").startswith("cuda") else "cpu"
    group = init_rank_group(tp, torch.device(kind), timeout_s=args.tp_timeout)
    if group.rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 stops the others
    return group


def console(group):
    """The console: rank 0 (or no group) prints, the other ranks are quiet."""
    from rich.console import Console

    if group is None or group.rank == 0:
        return Console()
    return Console(quiet=True, file=open(os.devnull, "w"))  # (progress lines write to con.file)


def follow(opt) -> int:
    """A non-zero rank: follow rank 0's steps until it says it is done (0), or fail with why (1)."""
    from ..runtime.distributed import follow as follow_steps

    group = opt.rank_group
    try:
        follow_steps(opt.engine.runner, group)
    except Exception as e:  # noqa: BLE001  (a lost rank 0: gloo's closed connection or timeout)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"devin-compile: error: tensor-parallel rank {group.rank} lost rank 0 ({first}); stopping",
              file=sys.stderr, flush=True)
        return 1
    return 0


def fatal_after(grace_s: float = 1.5):
    """``on_failure`` for :class:`~devin_compile.runtime.rank_watch.RankWatch`: print the message, then end
    the process (status 1) after ``grace_s`` (``/health`` answers 503 meanwhile); a rank group that lost a
    rank cannot be recovered, and its collectives would only hang."""
    def on_failure(message: str) -> None:
        print(f"devin-compile: error: {message}; exiting", file=sys.stderr, flush=True)
        threading.Timer(grace_s, os._exit, args=(1,)).start()

    return on_failure


def finish(opt) -> None:
    """Rank 0 is done: tell the other ranks, so they exit 0."""
    group = opt.rank_group
    if group is None or group.failure is not None:
        return
    try:
        with group.lock:
            group.broadcast(("done", None))
    except Exception as e:  # noqa: BLE001  (a rank already gone: the launcher or torchrun reports it)
        print(f"devin-compile: warning: could not tell the other ranks to stop ({str(e).splitlines()[0]})",
              file=sys.stderr, flush=True)
