"""Build and load the CPU C kernels (ctypes) and C++ torch op kernels (``*.c``/``*.cpp`` here).

The C kernel sources include only C headers (and ``cpu_kernels.h``), not torch's, so the system
C compiler (``$CC``, else ``cc``/``gcc``) builds one in about a second, with ``-O3
-march=native -fopenmp``; a C++ op kernel (``$CXX``, else ``c++``/``g++``) includes torch's headers
and takes ~10-30 s. Each is built once per machine and key into the shared cache of
:mod:`.kernel_cache` (locked, atomically installed, checksummed, logged at INFO): a C kernel keyed
by its sources, flags, the compiler's version and this CPU's feature flags, a C++ op kernel also by
torch's version, commit and C++ ABI. C kernels are loaded with ctypes, which drops the GIL during a
call. OpenMP resolves to the ``libgomp`` torch has already loaded, so the kernels share torch's
thread pool instead of starting a second one.

:class:`CKernel` and :class:`TorchOpKernel` build on first use. Where no compiler is found, one
warning per process says so (and how to get one), every kernel returns None/False and callers keep
their torch path; a build that fails for another reason is logged per kernel.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

from .kernel_cache import cached_build, cpu_flags

__all__ = ["CKernel", "TorchOpKernel", "CompilerMissing", "VARIANTS", "build", "build_torch_op", "cpu_flags",
           "find_compiler"]

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADERS = (HERE / "cpu_kernels.h", HERE / "cpu_torch_op.h", HERE / "cpu_paged_decode_avx512.h")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c11"]
CXX_FLAGS = ["-O2", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
_C = ("CC", "cc", "gcc")
_CXX = ("CXX", "c++", "g++")


class CompilerMissing(RuntimeError):
    """No usable C (or C++) compiler: the kernels are off and their ops run torch code."""


def find_compiler(env: str, *names: str) -> str | None:
    """The executable ``$env`` names (a path or a name on PATH) if set, else the first of ``names`` on
    PATH; None: no such compiler here."""
    chosen = os.environ.get(env)
    return shutil.which(chosen) if chosen else next((path for name in names if (path := shutil.which(name))), None)


def _where(env: str, *names: str) -> str:
    chosen = os.environ.get(env)
    return f"{env}={chosen} is not an executable" if chosen else f"{env} is unset and {' / '.join(names)} not on PATH"


def compilers(need_cxx: bool) -> tuple[str, str | None]:
    """``(cc, cxx)`` (cxx None unless ``need_cxx``), or :class:`CompilerMissing` naming every missing
    compiler (both, so that the one warning says all) and the way out."""
    cc, cxx = find_compiler(*_C), find_compiler(*_CXX)
    missing = {kind: _where(*spec) for kind, spec, path in (("C", _C, cc), ("C++", _CXX, cxx)) if path is None}
    if cc is None or (need_cxx and cxx is None):
        raise CompilerMissing(f"no {'/'.join(missing)} compiler found ({'; '.join(missing.values())}): devin-compile's "
                              "C/C++ kernels are off and their ops run slower torch code; install gcc and g++, or set "
                              "CC and CXX")
    return cc, cxx if need_cxx else None


_warned: set[str] = set()  # "compiler" once the missing compiler was reported
_warned_lock = threading.Lock()


def _unavailable(what: str, fallback: str, error: Exception) -> None:
    """Log why ``what`` cannot be built: a missing compiler once per process, other failures each."""
    if isinstance(error, CompilerMissing):
        with _warned_lock:
            first = "compiler" not in _warned
            _warned.add("compiler")
        if first:
            log.warning("%s", error)
        else:
            log.debug("the %s is unavailable: %s", what, error)
        return
    log.warning("the %s is unavailable (%s); %s", what, error, fallback)


@functools.lru_cache(maxsize=None)
def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


def _texts(*paths: Path) -> list[str]:
    return [p.read_text() for p in (*paths, *HEADERS)]


def build(source: Path, cc: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared object of C ``source``, compiled unless this exact build is cached.
    ``extra_flags`` follow the defaults (e.g. ``-mno-avx512f``: a variant without AVX-512)."""
    stem = source.stem + "".join(f.replace("-m", "_").replace("-", "_") for f in extra_flags)
    what = f"the C kernel {source.name}" + (f" ({' '.join(extra_flags)})" if extra_flags else "")
    return cached_build(what, stem, [*_texts(source), _version(cc), " ".join(FLAGS), *extra_flags],
                        lambda out, work: [[cc, *FLAGS, *extra_flags, f"-I{HERE}", "-o", out, str(source), "-lm"]])


def build_torch_op(cpp: Path, c_source: Path | None, cc: str, cxx: str) -> Path:
    """A shared object registering torch kernels from C++ ``cpp``, linked with C ``c_source``
    if given (for ``torch.ops.load_library``). Keyed also by torch's version, commit and C++ ABI
    (the library links against this torch's C++ API).
    ``-ffp-contract=off``: no fused multiply-adds, so a kernel can round like aten's ops do."""
    import torch
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"

    def commands(out: str, work: str) -> list[list[str]]:
        obj = [os.path.join(work, c_source.stem + ".o")] if c_source else []
        c_step = [[cc, *[f for f in FLAGS if f != "-shared"], f"-I{HERE}", "-c", "-o", *obj, str(c_source)]] if obj else []
        return [*c_step,
                [cxx, *CXX_FLAGS, abi,
                 f"-I{HERE}", *(f"-I{p}" for p in include_paths()), "-o", out, str(cpp), *obj, f"-L{torch_lib}",
                 "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}"]]

    sources = _texts(cpp, c_source) if c_source else _texts(cpp)
    what = f"the C++ op kernel {cpp.name}{f' (with {c_source.name})' if c_source else ''} for torch {torch.__version__}"
    key = [*sources, _version(cc), _version(cxx), " ".join(FLAGS + CXX_FLAGS), torch.__version__,
           str(torch.version.git_version), abi]
    return cached_build(what, cpp.stem, key, commands)


class TorchOpKernel:
    """A C++ file (next to this one) registering the CPU kernel of a ``devin::`` op, built with
    the system C/C++ compilers (``$CC``/``$CXX``) and loaded once per process with
    ``torch.ops.load_library``; ``c_source`` is a C kernel linked into it. The op's Python kernel
    (CompositeExplicitAutograd) serves every call where this cannot be built (logged)."""

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
            try:
                cc, cxx = compilers(need_cxx=True)
                importlib.import_module(self.op_module)  # the op must be defined before its kernels
                import torch

                torch.ops.load_library(str(build_torch_op(self.cpp, self.c_source, cc, cxx)))
                self._loaded = True
            except Exception as e:  # noqa: BLE001  (no compiler, headers missing, ABI mismatch)
                _unavailable(f"C++ kernel {self.cpp.name}", "the op's Python kernel serves every call", e)
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
            try:
                cc, _ = compilers(need_cxx=False)
                lib = ctypes.CDLL(str(build(self.source, cc, self.extra_flags)))
                for name, argtypes in self.functions.items():
                    fn = getattr(lib, name)
                    fn.argtypes = argtypes
                    fn.restype = ctypes.c_int
                self._lib = lib
            except Exception as e:  # noqa: BLE001  (no compiler, unsupported flags, sandboxed filesystem)
                _unavailable(f"C kernel {self.source.name}", "using the torch path", e)
                self._lib = None
            self._tried = True
            return self._lib
