"""Build, cache and load the CPU C kernels (``*.c`` next to this file) with ctypes.

The kernel sources include only C headers (and ``cpu_kernels.h``), not torch's, so the system
C compiler (``$CC``, else ``cc``/``gcc``) builds one in about a second, with ``-O3
-march=native -fopenmp``. The shared object is cached under ``~/.cache/devin_compile/kernels``
(``$DEVIN_COMPILE_CACHE/kernels``; the temp dir when that is read-only), keyed by a hash of the
sources, the flags, the compiler's version and this CPU's feature flags, and loaded with ctypes,
which drops the GIL during a call. OpenMP resolves to the ``libgomp`` torch has already
loaded, so the kernels share torch's thread pool instead of starting a second one.

:class:`CKernel` builds on first use; where no compiler works, :meth:`CKernel.load` logs why
once and returns None, and callers keep their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADERS = (HERE / "cpu_kernels.h",)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c11"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("DEVIN_COMPILE_CACHE")
    return Path(root) / "kernels" if root else Path.home() / ".cache" / "devin_compile" / "kernels"


def build(source: Path, cc: str) -> Path:
    """The shared object of ``source``, compiled unless this exact build is cached."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [source.read_text(), *(h.read_text() for h in HEADERS)]
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS), version, _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK):
            raise PermissionError(target.parent)
    except OSError:  # read-only home: build into the temp dir instead
        target = Path(tempfile.gettempdir()) / "devin_compile_kernels" / target.name
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        p = subprocess.run([cc, *FLAGS, f"-I{HERE}", "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                           timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{cc} failed: {p.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CKernel:
    """One C source, built and loaded once per process; ``setup(lib)`` declares its functions'
    ctypes signatures."""

    def __init__(self, source: str, setup: Callable[[ctypes.CDLL], None]) -> None:
        self.source = HERE / source
        self.setup = setup
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, building it the first time; None if it cannot be built here."""
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            try:
                if cc is None:
                    raise RuntimeError("no C compiler found (set CC)")
                lib = ctypes.CDLL(str(build(self.source, cc)))
                self.setup(lib)
                self._lib = lib
            except Exception as e:  # noqa: BLE001  (no compiler, unsupported flags, sandboxed filesystem)
                log.warning("the C kernel %s is unavailable (%s); using the torch path", self.source.name, e)
                self._lib = None
            self._tried = True
            return self._lib
