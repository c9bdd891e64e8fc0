"""The compile cache's folder: one entry per key, written atomically, checked, bounded (LRU).

Layout under the cache root (``$DEVIN_COMPILE_CACHE``, else ``~/.cache/devin_compile``)::

    programs/<key>/program.pkl    the compiled program: its graphs' code, tables, report (program_file.py)
                   tensors.pt     the weights the passes made (packed, fused, quantized), torch.save
                   key.json       the key's parts
                   checksums      the xxh3-128 of each file above; an entry is used only when all match
    programs/<key>.lock           held while the entry is written

An entry is written into a temporary folder beside it and renamed into place, so a reader sees
no entry or a whole one. A damaged entry (a flipped byte, a truncated file) is removed, rebuilt
and said so with one warning. Reading an entry refreshes its time stamp; writing one evicts the
least recently used entries beyond :data:`DEFAULT_MAX_BYTES` (``$DEVIN_COMPILE_CACHE_MAX_BYTES``);
an entry larger than the bound is not kept.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import xxhash
from filelock import FileLock

from ..backends.native.kernel_cache import cache_root, hold_lock

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 << 30
_STAMP = "checksums"
_CHUNK = 1 << 24


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``cache ls`` shows it."""

    key: str
    bytes: int
    last_used: float
    parts: dict


def off_by_env() -> bool:
    """``DEVIN_COMPILE_CACHE_OFF`` set to anything but empty or 0: the cache is off unless a folder is passed."""
    return os.environ.get("DEVIN_COMPILE_CACHE_OFF") not in (None, "", "0")


def max_bytes() -> int:
    text = os.environ.get("DEVIN_COMPILE_CACHE_MAX_BYTES")
    if text is None:
        return DEFAULT_MAX_BYTES
    if not text.isdigit():
        raise ValueError(f"DEVIN_COMPILE_CACHE_MAX_BYTES={text!r} must be a whole number of bytes")
    return int(text)


def _file_sum(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sums(folder: Path, names: list[str]) -> str:
    return "".join(f"{_file_sum(folder / n)}  {n}\n" for n in sorted(names))


class ProgramStore:
    """Entries under ``root/programs`` (``root`` defaults to the cache root)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_root()
        self.folder = self.root / "programs"

    def path(self, key: str) -> Path:
        return self.folder / key

    def damage(self, key: str) -> str | None:
        """None if the entry is whole, else what is wrong with it ("missing" when absent)."""
        entry = self.path(key)
        if not entry.is_dir():
            return "missing"
        try:
            recorded = (entry / _STAMP).read_text()
            names = [line.split("  ", 1)[1] for line in recorded.splitlines()]
            actual = _sums(entry, names)
        except (OSError, IndexError):
            return "a file or its checksum is missing"
        return None if actual == recorded else "its checksum does not match: damaged or overwritten"

    def read(self, key: str) -> Path | None:
        """The entry's folder when it is whole (its time stamp refreshed), else None."""
        if self.damage(key) is not None:
            return None
        os.utime(self.path(key) / _STAMP)
        return self.path(key)

    def lock(self, key: str) -> FileLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        return hold_lock(self.path(key), f"the compile-cache entry {key}")

    def write(self, key: str, fill: Callable[[Path], None]) -> bool:
        """Install the entry ``key`` (call under :meth:`lock`): ``fill(folder)`` writes its files into a
        temporary folder, which is checksummed and renamed into place; then evict beyond the bound.
        False (nothing kept) when the entry alone is larger than the bound."""
        self.folder.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=self.folder, prefix=".write-"))
        try:
            fill(work)
            names = [p.name for p in work.iterdir()]
            size = sum((work / n).stat().st_size for n in names)
            if size > max_bytes():
                log.info("compile cache: an entry of %.0f MB is larger than the bound (%.0f MB, "
                         "DEVIN_COMPILE_CACHE_MAX_BYTES); not kept", size / 1e6, max_bytes() / 1e6)
                return False
            (work / _STAMP).write_text(_sums(work, names))
            self.remove(key)
            os.replace(work, self.path(key))  # atomic: readers see no entry or the whole one
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self.evict(max_bytes(), keep=key)
        return True

    def remove(self, key: str) -> None:
        shutil.rmtree(self.path(key), ignore_errors=True)

    def entries(self) -> list[EntryInfo]:
        """Every entry, least recently used first."""
        out = []
        for entry in self.folder.glob("*"):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            try:
                size = sum(p.stat().st_size for p in entry.iterdir())
                used = (entry / _STAMP).stat().st_mtime
                parts = json.loads((entry / "key.json").read_text()).get("parts", {})
            except (OSError, ValueError):
                size, used, parts = 0, 0.0, {}
            out.append(EntryInfo(entry.name, size, used, parts))
        return sorted(out, key=lambda e: e.last_used)

    def evict(self, limit: int, keep: str | None = None) -> list[str]:
        """Remove least recently used entries (never ``keep``) until the entries fit in ``limit`` bytes."""
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        removed = []
        for e in entries:
            if total <= limit:
                break
            if e.key == keep:
                continue
            self.remove(e.key)
            total -= e.bytes
            removed.append(e.key)
        if removed:
            log.info("compile cache: evicted %d least recently used entries (bound %d bytes)", len(removed), limit)
        return removed

    def clear(self) -> int:
        """Remove every entry; returns the bytes freed."""
        freed = sum(e.bytes for e in self.entries())
        shutil.rmtree(self.folder, ignore_errors=True)
        return freed


def age(seconds_since_epoch: float) -> str:
    """How long ago, as ``cache ls`` shows it."""
    d = max(0.0, time.time() - seconds_since_epoch)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.0f}h ago"
