"""Progress of the long quantization steps (calibration, each method's per-layer loop, validate).

``progress=`` everywhere in :mod:`devin_compile.quant` takes

- ``True`` (the default): log lines through :mod:`logging` (logger ``devin_compile.quant``, a child
  of ``devin_compile``, level INFO): one when a loop starts, one at each tenth of it with the
  elapsed time and an estimate of the time left (ETA), one when it ends (:class:`LogLines`).
  Python shows them once logging is set up at INFO, e.g. ``logging.basicConfig(level="INFO")``;
- ``False`` / ``None``: silent;
- a callable ``fn(done, total, *info)``: called after each step, ``done`` rising from 0 or 1 to
  ``total`` (``info[0]``, where given, names the item just done). If it also has a method
  ``stage(desc, total)``, that is called when each loop starts (the CLI names its rich bars so).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Union

ProgressArg = Union[bool, None, Callable[..., Any]]
LOG = logging.getLogger("devin_compile.quant")


def check_progress(value: Any, what: str = "progress") -> None:
    """``ValueError`` unless ``value`` is a valid ``progress=`` argument."""
    if not (value is None or isinstance(value, bool) or callable(value)):
        raise ValueError(f"{what}={value!r} must be True (log lines through logging), False (silent) "
                         "or a callable fn(done, total, ...)")


def clock(seconds: float) -> str:
    """``12.3s``, ``4m05s`` or ``1h02m``: a duration as a person reads it in a log."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def stage(progress: ProgressArg, text: str) -> None:
    """One log line naming a step without a loop of its own, when ``progress`` is True."""
    if progress is True:
        LOG.info("%s", text)


class LogLines:
    """INFO lines for a loop of ``total`` steps: when it starts, at each tenth, and when it ends."""

    def __init__(self, total: int, desc: str, log: logging.Logger = LOG, now: Callable[[], float] = time.perf_counter):
        self.total, self.desc, self.log, self.now = total, desc, log, now
        self.t0 = now()
        self.tenths = 0
        log.info("%s: started, %d steps", desc, total)

    def update(self, done: int, *info: Any) -> None:
        tenths = 10 if done >= self.total else done * 10 // max(self.total, 1)
        if tenths <= self.tenths:
            return
        self.tenths = tenths
        elapsed = self.now() - self.t0
        head = f"{self.desc}: {done}/{self.total} ({100 * done // max(self.total, 1)}%)"
        if done >= self.total:
            self.log.info("%s, done in %s", head, clock(elapsed))
            return
        eta = elapsed / done * (self.total - done)
        item = f" [{info[0]}]" if info else ""
        self.log.info("%s, elapsed %s, ETA %s%s", head, clock(elapsed), clock(eta), item)


class Progress:
    """``p = Progress(progress, total, desc)``, then ``p.update(done, *info)`` after each step."""

    def __init__(self, progress: ProgressArg, total: int, desc: str):
        check_progress(progress)
        self.fn = progress if callable(progress) else None
        self.lines = LogLines(total, desc) if progress is True else None
        self.total = total
        if self.fn is not None and callable(getattr(self.fn, "stage", None)):
            self.fn.stage(desc, total)

    def update(self, done: int, *info: Any) -> None:
        if self.fn is not None:
            self.fn(done, self.total, *info)
        if self.lines is not None:
            self.lines.update(done, *info)
