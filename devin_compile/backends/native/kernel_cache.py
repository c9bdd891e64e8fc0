"""The on-disk cache of built kernels: each shared object built once per machine, then loaded.

Entries live in ``~/.cache/devin_compile/kernels`` (``$DEVIN_COMPILE_CACHE/kernels``; a folder in
the temp dir when that one is not writable), shared by every process and virtualenv of the user.
An entry's name is ``<stem>-<key>.so``, the key a hash of what the caller says decides the build
(sources, compiler version, flags, torch version for torch ops), this CPU's feature flags and
:data:`FORMAT`.

A build runs under a file lock beside its entry (``<entry>.lock``, ``filelock``), so concurrent
first starts build once: the others wait for it and then load its result. The builder writes into
a temporary folder in the same directory and installs the shared object with an atomic rename,
then its SHA-256 (``<entry>.sha256``, also renamed into place). An entry is used only when that
checksum matches: a truncated or damaged file (a full disk, a killed copy) is rebuilt, with a
warning. What is built and how long it took is logged (INFO, logger ``devin_compile...``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

#: Part of every key: bumped when an entry's layout changes (2: the checksum sidecar).
FORMAT = "2"
#: How long a process waits for another one's build of the same entry before giving up.
LOCK_TIMEOUT_S = 1800.0

Commands = Callable[[str, str], list[list[str]]]


def cpu_flags() -> str:
    """This CPU's feature flags (the ``flags`` line of /proc/cpuinfo): builds use ``-march=native``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_root() -> Path:
    """The root of devin-compile's on-disk caches: ``$DEVIN_COMPILE_CACHE``, else ``~/.cache/devin_compile``."""
    root = os.environ.get("DEVIN_COMPILE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "devin_compile"


def cache_dir() -> Path:
    return cache_root() / "kernels"


def entry_path(stem: str, key_parts: list[str]) -> Path:
    """Where the build of ``stem`` keyed by ``key_parts`` lives (a writable folder)."""
    key = hashlib.sha256("\0".join([FORMAT, *key_parts, cpu_flags(), platform.machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.access(target.parent, os.W_OK):
            return target
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / "devin_compile_kernels" / target.name  # read-only home
    fallback.parent.mkdir(parents=True, exist_ok=True)
    return fallback


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checksum_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def damage(target: Path) -> str | None:
    """None if ``target`` is a complete entry, else what is wrong with it ("missing" when absent)."""
    if not target.exists():
        return "missing"
    try:
        expected = _checksum_path(target).read_text().strip()
    except OSError:
        return "no checksum recorded"
    return None if _digest(target) == expected else "its checksum does not match: truncated or overwritten"


def _install(target: Path, commands: Commands) -> None:
    """Run the build in a temporary folder beside ``target`` and rename its result into place."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        out = os.path.join(work, target.name)
        for cmd in commands(out, work):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"{cmd[0]} failed: {p.stderr.strip()[-2000:]}")
        checksum = os.path.join(work, "checksum")
        Path(checksum).write_text(_digest(Path(out)) + "\n")
        os.replace(out, target)  # atomic: a reader sees the old file or the whole new one
        os.replace(checksum, _checksum_path(target))


def hold_lock(target: Path, what: str) -> FileLock:
    """The entry's file lock (``<target>.lock``), acquired; says so (INFO) when another process
    holds it, and gives up with a ``RuntimeError`` after :data:`LOCK_TIMEOUT_S`."""
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process to finish writing %s (lock %s)", what, lock.lock_file)
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout:
            raise RuntimeError(f"another process has held {lock.lock_file} for {LOCK_TIMEOUT_S:.0f} s while "
                               f"writing {what}; end it, or point DEVIN_COMPILE_CACHE elsewhere") from None
    return lock


def cached_build(what: str, stem: str, key_parts: list[str], commands: Commands) -> Path:
    """The cached shared object for ``key_parts``, built first (once on this machine) if needed.

    ``commands(out, workdir)`` gives the argv lists that write the shared object ``out``; ``what``
    names the build in the log ("the C kernel arena_reuse.c")."""
    target = entry_path(stem, key_parts)
    if damage(target) is None:
        return target
    lock = hold_lock(target, what)
    try:
        problem = damage(target)  # another process may have built it while this one waited
        if problem is None:
            return target
        if problem != "missing":
            log.warning("the cached %s at %s is damaged (%s); rebuilding it", what, target, problem)
        log.info("building %s (once per machine; later starts load it from %s)", what, target.parent)
        start = time.perf_counter()
        _install(target, commands)
        log.info("built %s in %.1f s", what, time.perf_counter() - start)
        return target
    finally:
        lock.release()
