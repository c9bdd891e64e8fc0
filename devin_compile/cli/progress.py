"""Progress in the CLI: rich bars on a terminal, plain lines elsewhere, nothing with ``--quiet``.

Rich draws its bars (and spinners) only when the console is a terminal; piped into a file or a
CI log it would print nothing until the end. So off a terminal :class:`Bars` shows the library's
own log lines (:mod:`devin_compile.quant.progress`: a line when a loop starts, at each tenth with
the elapsed time and ETA, at its end) by routing the ``devin_compile`` logger to the console, and
:func:`stage` prints one line where a terminal gets a spinner.
"""
from __future__ import annotations

import contextlib
import logging
import sys


def plain(con) -> bool:
    """Whether ``con`` is not a terminal (a pipe, a file): plain lines instead of bars and spinners."""
    return not con.is_terminal


@contextlib.contextmanager
def stage(con, text: str):
    """A spinner showing ``text`` on a terminal; elsewhere ``text`` as one line, flushed at once."""
    if plain(con):
        _write(con, text)
        yield
        return
    with con.status(text):
        yield


def _write(con, text: str) -> None:
    out = con.file or sys.stdout
    out.write(text + "\n")
    out.flush()


class _ConsoleHandler(logging.Handler):
    """Log records as plain lines on the console's stream, each flushed (a pipe shows it at once)."""

    def __init__(self, con):
        super().__init__(logging.INFO)
        self.con = con

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _write(self.con, self.format(record))
        except Exception:  # logging's contract: a handler never raises
            self.handleError(record)


class _RichCallback:
    """A ``progress=`` callable drawing one rich bar per loop, named by the loop's ``stage``."""

    def __init__(self, prog):
        self.prog = prog
        self.task = None
        self.desc = ""

    def stage(self, desc: str, total: int) -> None:
        self.desc = desc
        self.task = self.prog.add_task(desc, total=total)

    def __call__(self, done: int, total: int, *info) -> None:
        if self.task is None:
            self.stage("working", total)
        what = f"{self.desc}: {info[0]}" if info else self.desc
        self.prog.update(self.task, completed=done, description=what)


class Bars:
    """``with Bars(con, quiet) as bars: f(..., progress=bars.progress)``: on a terminal a rich bar per
    loop, elsewhere the library's log lines on the console, with ``quiet`` nothing."""

    def __init__(self, con, quiet: bool = False):
        self.con = con
        self.mode = "off" if quiet else "lines" if plain(con) else "bars"
        self.prog = None
        self.handler = None
        self.progress = False
        if self.mode == "bars":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self.prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=con, transient=False)
            self.progress = _RichCallback(self.prog)
        elif self.mode == "lines":
            self.progress = True

    def __enter__(self) -> "Bars":
        if self.prog is not None:
            self.prog.__enter__()
        if self.mode == "lines":
            log = logging.getLogger("devin_compile")
            self.handler, self.level = _ConsoleHandler(self.con), log.level
            log.addHandler(self.handler)
            if log.getEffectiveLevel() > logging.INFO:
                log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        if self.prog is not None:
            self.prog.__exit__(*exc)
        if self.handler is not None:
            log = logging.getLogger("devin_compile")
            log.removeHandler(self.handler)
            log.setLevel(self.level)
            self.handler = None
