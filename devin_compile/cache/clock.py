"""A clock that never runs backward, for deadlines that must hold under clock jumps.

Cache deadlines are points on this clock: ``deadline = now() + ttl_s`` when an entry is set,
and the entry is gone once ``now() >= deadline`` (exactly at its deadline, not one tick later).

- A **forward** jump of the underlying clock is elapsed time: every entry whose deadline the
  jump passes expires at once.
- A **backward** jump counts as no time at all: :meth:`SteadyClock.now` stays where it was and
  continues from there, so an entry neither comes back after it expired nor loses or gains
  lifetime; what it had left at the jump, it still has afterwards, counted as the underlying
  clock moves forward again.

The default source is :func:`time.monotonic`, which does not jump backward; the rule matters
for an injected clock (tests, or wall time).
"""
from __future__ import annotations

import threading
import time
from typing import Callable


class SteadyClock:
    """``source() + offset``, where ``offset`` absorbs every backward step of ``source``."""

    def __init__(self, source: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._offset = 0.0
        self._last: float | None = None
        self._lock = threading.Lock()

    def now(self) -> float:
        """Seconds on the steady clock: never smaller than any value returned before."""
        with self._lock:
            raw = float(self._source())
            if self._last is not None:
                now = raw + self._offset
                if now < self._last:  # the source jumped backward: resume from where we were
                    self._offset += self._last - now
                    now = self._last
            else:
                now = raw
            self._last = now
            return now
