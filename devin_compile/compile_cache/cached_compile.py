"""Read a compiled program from the cache, or build it and store it: :func:`cached_compile`.

A whole entry (checksums match) is read and bound to the live model: status ``hit``. A damaged or
unreadable one is removed, rebuilt and said so with one warning (``rebuilt``); never used. A
missing one is built under the entry's file lock (``miss``): a second process starting the same
model meanwhile waits for it and then reads it (``hit``) instead of compiling again. A program
the cache cannot write is used as built and not stored (``not cacheable``, logged at INFO with
the reason).
"""
from __future__ import annotations

import json
import logging
import pickle
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from .key import KeyParts
from .program_file import Compiled, NotCacheable, load, save
from .store import ProgramStore

log = logging.getLogger(__name__)

_UNREADABLE = (OSError, EOFError, pickle.UnpicklingError, RuntimeError, AttributeError, KeyError, ValueError,
               TypeError, ImportError, IndexError)


def _read(store: ProgramStore, key: str, model: torch.nn.Module) -> Compiled | None:
    """The entry ``key`` loaded, or None when it is absent, damaged or unreadable (damaged or unreadable:
    removed, with one warning)."""
    folder = store.read(key)
    problem = None
    if folder is not None:
        try:
            return load(folder, model)
        except _UNREADABLE as e:
            problem = f"it could not be read back ({type(e).__name__}: {e})"
    else:
        problem = store.damage(key)
        if problem == "missing":
            return None
    log.warning("compile cache: the entry %s is damaged (%s); removing it and compiling again", key, problem)
    store.remove(key)
    return None


def cached_compile(model: torch.nn.Module, parts: KeyParts,
                   build: Callable[[], Compiled], root: Path | None = None) -> tuple[Compiled, str]:
    """``(compiled, status)``: the entry for ``parts`` read back, or ``build()`` run and stored."""
    store = ProgramStore(root)
    key = parts.digest()
    had_entry = store.path(key).exists()
    found = _read(store, key, model)
    if found is not None:
        return found, "hit"
    with store.lock(key):
        if not had_entry:  # another process may have written it while this one waited for the lock
            found = _read(store, key, model)
            if found is not None:
                return found, "hit"
        compiled = build()

        def fill(folder: Path) -> None:
            save(folder, compiled, model)
            (folder / "key.json").write_text(json.dumps({"key": key, "parts": asdict(parts)}, indent=1))

        try:
            kept = store.write(key, fill)
        except NotCacheable as e:
            log.info("compile cache: this program is not cached: it holds %s", e)
            return compiled, "not cacheable"
    status = "rebuilt" if had_entry else "miss"
    return compiled, status if kept else f"{status}, not kept"
