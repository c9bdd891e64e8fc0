"""How the command line shows the library's log: ``devin_compile``'s records from INFO up on stderr.

The library logs what takes time or changes behaviour (a kernel being built and how long it took,
a missing compiler, a torch.compile graph compiled) through the ``logging`` logger
``devin_compile``; a library leaves showing that to its caller, and the ``devin-compile`` command
is that caller. Lines read ``devin-compile: <message>`` (``devin-compile: warning: <message>`` from
WARNING up), so they stay apart from a subcommand's results on stdout.
"""
from __future__ import annotations

import logging
import sys


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (tests swap it)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        return f"devin-compile: {level}{super().format(record)}"


def show_library_log(level: int = logging.INFO) -> logging.Handler:
    """Send the ``devin_compile`` logger's records from ``level`` up to stderr (one handler per process,
    its level set by the latest call; returns the handler)."""
    logger = logging.getLogger("devin_compile")
    handler = next((h for h in logger.handlers if isinstance(h, _Stderr)), None)
    if handler is None:
        handler = _Stderr()
        handler.setFormatter(_Format("%(message)s"))
        logger.addHandler(handler)
    handler.setLevel(level)  # a later call (--quiet: WARNING) changes what it shows
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    return handler
