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
import importlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADERS = (HERE / "cpu_kernels.h", HERE / "cpu_torch_op.h")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c11"]


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def find_compiler(env: str, *names: str) -> str | None:
    """``$env`` if set, else the first of ``names`` on PATH (None: no such compiler here)."""
    return os.environ.get(env) or next((path for name in names if (path := shutil.which(name))), None)


def cache_dir() -> Path:
    root = os.environ.get("DEVIN_COMPILE_CACHE")
    return Path(root) / "kernels" if root else Path.home() / ".cache" / "devin_compile" / "kernels"


def _cached_build(stem: str, key_parts: list[str], commands) -> Path:
    """Run ``commands(out, workdir)`` (a list of argv lists writing the shared object ``out``)
    unless a build with the same key is cached; returns the cached shared object."""
    key = hashlib.sha256("\0".join([*key_parts, " ".join(FLAGS), cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
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
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        tmp = os.path.join(work, target.name)
        for cmd in commands(tmp, work):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"{cmd[0]} failed: {p.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each install a complete file
    return target


def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


def _texts(*paths: Path) -> list[str]:
    return [p.read_text() for p in (*paths, *HEADERS)]


def build(source: Path, cc: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared object of C ``source``, compiled unless this exact build is cached.
    ``extra_flags`` follow the defaults (e.g. ``-mno-avx512f``: a variant without AVX-512)."""
    stem = source.stem + "".join(f.replace("-m", "_").replace("-", "_") for f in extra_flags)
    return _cached_build(stem, [*_texts(source), _version(cc), *extra_flags],
                         lambda out, work: [[cc, *FLAGS, *extra_flags, f"-I{HERE}", "-o", out, str(source), "-lm"]])


def build_torch_op(cpp: Path, c_source: Path | None, cc: str, cxx: str) -> Path:
    """A shared object registering torch kernels from C++ ``cpp``, linked with C ``c_source``
    if given (for ``torch.ops.load_library``). Keyed also by torch's version and C++ ABI.
    ``-ffp-contract=off``: no fused multiply-adds, so a kernel can round like aten's ops do."""
    import torch
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"

    def commands(out: str, work: str) -> list[list[str]]:
        obj = [os.path.join(work, c_source.stem + ".o")] if c_source else []
        c_step = [[cc, *[f for f in FLAGS if f != "-shared"], f"-I{HERE}", "-c", "-o", *obj, str(c_source)]] if obj else []
        return [*c_step,
                [cxx, "-O2", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17", abi,
                 f"-I{HERE}", *(f"-I{p}" for p in include_paths()), "-o", out, str(cpp), *obj, f"-L{torch_lib}",
                 "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}"]]

    sources = _texts(cpp, c_source) if c_source else _texts(cpp)
    return _cached_build(cpp.stem, [*sources, _version(cc), _version(cxx), torch.__version__, abi], commands)


class TorchOpKernel:
    """A C++ file (next to this one) registering the CPU kernel of a ``devin::`` op, built with
    the system C/C++ compilers (``$CC``/``$CXX``) and loaded once per process with
    ``torch.ops.load_library``; ``c_source`` is a C kernel linked into it. The op's Python kernel
    (CompositeExplicitAutograd) serves every call where this cannot be built (logged once)."""

    def __init__(self, cpp: str, op_module: str, c_source: str | None = None) -> None:
        self.cpp = HERE / cpp
        self.op_module = op_module
        self.c_source = HERE / c_source if c_source else None
        self._loaded: bool | None = None
        self._lock = threading.Lock()

    def load(self) -> bool:
        """Register the C++ kernel (building it the first time); False if it cannot be built here."""
        if self._loaded is not None:
            return self._loaded
        with self._lock:
            if self._loaded is not None:
                return self._loaded
            cc, cxx = find_compiler("CC", "cc", "gcc"), find_compiler("CXX", "c++", "g++")
            try:
                if cc is None or cxx is None:
                    raise RuntimeError("no C/C++ compiler found (set CC and CXX)")
                importlib.import_module(self.op_module)  # the op must be defined before its kernels
                import torch

                torch.ops.load_library(str(build_torch_op(self.cpp, self.c_source, cc, cxx)))
                self._loaded = True
            except Exception as e:  # noqa: BLE001  (no compiler, headers missing, ABI mismatch)
                log.warning("the C++ kernel %s is unavailable (%s); the op's Python kernel serves every call",
                            self.cpp.name, e)
                self._loaded = False
            return self._loaded


# Builds of a source with instruction sets turned off, so that one machine tests the code paths of
# smaller ones (each runs where the native build does: the flags only take features away).
VARIANTS = {"native": (), "avx512_no_vnni": ("-mno-avx512vnni",), "avx512_no_bf16": ("-mno-avx512bf16",),
            "avx512_no_vbmi": ("-mno-avx512vbmi",), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2",)}


class CKernel:
    """One C source, built and loaded once per process; ``functions`` maps each exported
    function to its ctypes argument types (every one returns an int status)."""

    def __init__(self, source: str, functions: dict[str, list], extra_flags: tuple[str, ...] = ()) -> None:
        self.source = HERE / source
        self.functions = functions
        self.extra_flags = extra_flags
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()
        self._variants: dict[str, CKernel] = {}

    def variant(self, name: str) -> "CKernel":
        """This source built with :data:`VARIANTS` ``[name]`` added to the flags (tests)."""
        if name == "native":
            return self
        if name not in self._variants:
            self._variants[name] = CKernel(self.source.name, self.functions, (*self.extra_flags, *VARIANTS[name]))
        return self._variants[name]

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, building it the first time; None if it cannot be built here."""
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            cc = find_compiler("CC", "cc", "gcc")
            try:
                if cc is None:
                    raise RuntimeError("no C compiler found (set CC)")
                lib = ctypes.CDLL(str(build(self.source, cc, self.extra_flags)))
                for name, argtypes in self.functions.items():
                    fn = getattr(lib, name)
                    fn.argtypes = argtypes
                    fn.restype = ctypes.c_int
                self._lib = lib
            except Exception as e:  # noqa: BLE001  (no compiler, unsupported flags, sandboxed filesystem)
                log.warning("the C kernel %s is unavailable (%s); using the torch path", self.source.name, e)
                self._lib = None
            self._tried = True
            return self._lib
