"""torch's own compile caches (Inductor's FX-graph cache, AOTAutograd's cache) under the compile cache's root.

``compile_decode`` and the ``torch.compile`` backend leave their generated code to those caches, which
torch keeps in ``$TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``: gone after a reboot,
and not what ``devin-compile cache ls|clear`` shows). :func:`use_inductor_cache` points them at
``<root>/inductor`` instead, unless ``TORCHINDUCTOR_CACHE_DIR`` is already set, by the user or by
torch itself on its first compile in this process (moving it then would split one process's caches
over two folders).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..backends.native.kernel_cache import cache_root

SUBDIR = "inductor"


def inductor_dir(root: Path | None = None) -> Path:
    """Where :func:`use_inductor_cache` puts torch's compile caches for the cache root ``root``."""
    return (root if root is not None else cache_root()) / SUBDIR


def use_inductor_cache(root: Path | None = None) -> str:
    """Point torch's compile caches at ``<root>/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set;
    the folder they use, either way."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir(root).resolve()))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def inductor_bytes(root: Path | None = None) -> int:
    """The bytes under ``<root>/inductor`` (0 when it does not exist)."""
    folder = inductor_dir(root)
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def clear_inductor(root: Path | None = None) -> int:
    """Remove ``<root>/inductor``; the bytes freed."""
    size = inductor_bytes(root)
    shutil.rmtree(inductor_dir(root), ignore_errors=True)
    return size
