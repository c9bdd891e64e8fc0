"""Reuse CPython's freed arena blocks so calls across a frame-stack chunk boundary stay cheap.

CPython 3.11/3.12 map a fresh 16 KiB chunk for the frame stack whenever a call crosses the end
of the current one, and unmap it when that call returns (python/cpython#142183, fixed in 3.13
by caching a chunk). An eager decode step that calls hundreds of ops from one FX ``forward``
frame can sit on that boundary for a whole run: every op call then costs an mmap, a page fault
and an munmap, which on a VM means a cross-core TLB shoot-down. Whether it happens depends on
the caller's stack depth, so the same model decoded at half speed under one benchmark script
and at full speed under another (SmolLM2 INT4, eager: 21 vs 45 tok/s).

:func:`install` puts the small C reuse pool of ``arena_reuse.c`` in front of the arena allocator
(``PyObject_SetArenaAllocator``): up to 4 freed frame-stack chunks (< 1 MiB) and 4 freed pymalloc
arenas (1 MiB) are kept, each class in its own slots (the one freed longest ago goes back when they
are full), and handed back to the next allocation of the same size; everything else goes to the
previous allocator. The
engine installs it once per process on CPython < 3.13. ``DEVIN_COMPILE_ARENA_CACHE=0`` turns
it off; without a C compiler it is skipped (logged).
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

from ..backends.native.build import CKernel

class _ArenaAllocator(ctypes.Structure):
    """``PyObjectArenaAllocator``: ctx, alloc(ctx, size), free(ctx, ptr, size)."""
    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


_KERNEL = CKernel("arena_reuse.c", {
    "devin_arena_reuse_init": [ctypes.POINTER(_ArenaAllocator), ctypes.POINTER(_ArenaAllocator)],
    "devin_arena_reuse_stats": [ctypes.POINTER(ctypes.c_int64)],
})
_lock = threading.Lock()
_state: dict[str, bool] = {}


def needed() -> bool:
    """Whether this interpreter has the chunk churn (CPython before 3.13) and it is not turned off."""
    return (sys.implementation.name == "cpython" and sys.version_info < (3, 13)
            and os.environ.get("DEVIN_COMPILE_ARENA_CACHE", "1") != "0")


def install() -> bool:
    """Install the reuse pool once per process where :func:`needed`; True if it is in place."""
    with _lock:
        if "installed" in _state:
            return _state["installed"]
        ok = False
        if needed():
            lib = _KERNEL.load()
            if lib is not None:
                api = ctypes.pythonapi  # holds the GIL across each call, as these functions require
                api.PyObject_GetArenaAllocator.argtypes = [ctypes.POINTER(_ArenaAllocator)]
                api.PyObject_GetArenaAllocator.restype = None
                api.PyObject_SetArenaAllocator.argtypes = [ctypes.POINTER(_ArenaAllocator)]
                api.PyObject_SetArenaAllocator.restype = None
                prev, mine = _ArenaAllocator(), _ArenaAllocator()
                api.PyObject_GetArenaAllocator(ctypes.byref(prev))
                if lib.devin_arena_reuse_init(ctypes.byref(prev), ctypes.byref(mine)) == 0:
                    api.PyObject_SetArenaAllocator(ctypes.byref(mine))
                ok = True
        _state["installed"] = ok
        return ok


def stats() -> dict[str, int]:
    """Allocations served from the pool (``hits``), passed on (``misses``), frees passed on."""
    lib = _KERNEL.load() if _state.get("installed") else None
    if lib is None:
        return {"hits": 0, "misses": 0, "released": 0}
    out = (ctypes.c_int64 * 3)()
    lib.devin_arena_reuse_stats(out)
    return {"hits": out[0], "misses": out[1], "released": out[2]}
