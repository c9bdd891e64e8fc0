"""RankWatch: a long-running tensor-parallel front (the server) notices a rank that died or hangs.

Rank 0's step thread meets the other ranks only while requests run; an idle server would not notice
a lost rank, and the other ranks, waiting for rank 0's next message, would hit the process group's
timeout. So every ``interval_s`` that no step holds the group, the watch pings it
(:meth:`~.distributed.RankGroup.ping`: a message and an all_reduce every rank answers): a dead rank
makes it raise at once (gloo sees the closed connection), a hung one within the group's timeout.
A step that meets a lost rank raises the same way and fails the engine; ``probe`` reports that.

Either way the watch records why in ``RankGroup.failure`` (``/health`` answers 503 with it) and calls
``on_failure(message)`` once: the CLI prints the message and exits, and its launcher stops the other
ranks (runtime/distributed.py has the messages; cli/launch.py the processes).
"""
from __future__ import annotations

import threading
from typing import Callable

from .distributed import RankGroup


class RankWatch:
    def __init__(self, group: RankGroup, interval_s: float, on_failure: Callable[[str], None],
                 probe: Callable[[], BaseException | None] = lambda: None) -> None:
        if group.rank != 0:
            raise ValueError("RankWatch runs on rank 0 (the other ranks follow its messages)")
        self.group = group
        self.interval_s = interval_s
        self.on_failure = on_failure
        self.probe = probe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devin-rank-watch", daemon=True)

    def start(self) -> "RankWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop pinging (before rank 0 tells the other ranks it is done); returns once no ping is under way."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            error = self.probe()
            if error is not None:
                return self._fail(f"an engine step failed ({type(error).__name__}: {error})")
            try:
                self.group.ping(blocking=False)
            except Exception as e:  # noqa: BLE001  (gloo/NCCL: a closed connection or a timeout)
                first = str(e).splitlines()[0] if str(e) else ""
                return self._fail(f"a rank stopped answering ({type(e).__name__}: {first})")

    def _fail(self, why: str) -> None:
        message = (f"tensor-parallel group of {self.group.world_size} ranks lost: {why}; the ranks cannot "
                   "go on without it")
        self.group.failure = message
        self.on_failure(message)
