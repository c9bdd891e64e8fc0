"""A C kernel for paged decode attention on CPU (``cpu_paged_decode.c``), built on first use.

Decode attention is memory-bound: each step reads every cached key and value once. The
torch paths around it pay for copies instead: gather + cast + SDPA reads and writes each
K/V row three times more, and an Inductor-generated kernel over the same gathers (used here
before this one) did not vectorise its indirect loads. Measured on this 2-core AVX2 CPU (bf16
pool, 24 sequences of 300–600 cached tokens, SmolLM2's 9 query / 3 KV heads of 64, one layer,
cache-warm): gather + SDPA 7.7–14 ms, the Inductor kernel 2.7 ms, this kernel 0.7 ms.

The source has no torch headers, so the system C compiler (``$CC``, else ``cc``) builds it in
about a second, with ``-O3 -march=native -fopenmp``; the shared object is cached under
``~/.cache/devin_compile/kernels`` (``$DEVIN_COMPILE_CACHE``), keyed by a hash of the
source, the flags, the compiler's version and this CPU's feature flags, and loaded with
ctypes (which drops the GIL during the call). OpenMP resolves to the ``libgomp`` torch has
already loaded, so the kernel shares torch's thread pool instead of starting a second one.
Where no compiler works, :func:`load` returns None once and callers keep their torch path.

Contract of :func:`decode_attention`: ``q`` [T, Hq, D] (float32, bf16 or fp16, contiguous
in its last dim), caches [blocks, block_size, Hkv, D] in q's dtype, ``rows`` int64 [n] the
q/out row of each sequence, ``tables`` int32 [n, M] block tables, ``lens`` int32 [n] cached
keys (attends to slots ``0 .. lens[b]-1``; 0 gives zeros). Writes ``out[rows]`` ([T, Hq, Dv],
q's dtype), and optionally the attention mass per cached key (KV pruning's scores). Float32
arithmetic throughout.
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c11"]
CHUNK = 256  # most keys per task; fewer when the step has few keys, so every thread gets work
MIN_CHUNK = 32
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i = ctypes.c_int
_ARGTYPES = [_p, _i64, _i64, _p,  # q, strides, rows
             _p, _i64, _i64, _i64,  # k cache and strides
             _p, _i64, _i64, _i64,  # v cache and strides
             _p, _i64, _p,  # tables, table stride, lens
             _p, _i64, _i64,  # out and strides
             _p, _i64, _i64,  # mass (or NULL) and strides
             _i, _i, _i, _i, _i, _i,  # n, Hkv, G, D, Dv, block_size
             ctypes.c_float, _i, _i, _i]  # scale, dtype, threads, chunk


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


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_paged_decode-{key}.so"
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
        p = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{cc} failed: {p.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it the first time; None if it cannot be built here."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        try:
            if cc is None:
                raise RuntimeError("no C compiler found (set CC)")
            lib = ctypes.CDLL(str(_build(cc)))
            fn = lib.devin_paged_decode_attention
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int
            _lib = lib
        except Exception as e:  # noqa: BLE001  (no compiler, unsupported flags, sandboxed filesystem)
            log.warning("the C decode-attention kernel is unavailable (%s); using the torch path", e)
            _lib = None
        _tried = True
        return _lib


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype == v_cache.dtype
            and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and q.shape[-1] <= 512 and v_cache.shape[-1] <= 512 and q.shape[1] // k_cache.shape[2] <= 32
            and q.shape[1] % k_cache.shape[2] == 0)


def chunk_for(total_keys: int, threads: int | None = None) -> int:
    """Keys per task: :data:`CHUNK`, or less so a step has about 4 tasks per thread."""
    threads = threads or torch.get_num_threads()
    want = -(-total_keys // (4 * threads))
    return max(MIN_CHUNK, min(CHUNK, -(-want // 16) * 16))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, scale: float, out: torch.Tensor,
                     mass: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """See the module docstring. ``out`` must be [T, Hq, Dv] in q's dtype, last dim contiguous.
    ``mass`` (optional, float32 [n, Hkv, >= max(lens)], last dim contiguous) receives each
    cached key's softmax weight summed over the query heads of its KV head (entries past
    ``lens[b]`` are left as they are): what KV pruning scores tokens by. ``chunk``: keys per
    task (default :func:`chunk_for` the step's keys; callers with host-side lengths pass it)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the C decode-attention kernel is unavailable on this machine (see the log)")
    n = rows.shape[0]
    hkv = k_cache.shape[2]
    assert rows.dtype == torch.int64 and tables.dtype == torch.int32 and lens.dtype == torch.int32
    assert rows.is_contiguous() and lens.is_contiguous() and tables.stride(-1) == 1 and out.dtype == q.dtype
    assert tables.shape[0] == n == lens.shape[0] and out.stride(-1) == 1
    if mass is not None:
        assert mass.dtype == torch.float32 and mass.stride(-1) == 1 and mass.shape[:2] == (n, hkv)
        assert n == 0 or mass.shape[2] >= int(lens.max())
    rc = lib.devin_paged_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), rows.data_ptr(),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        None if mass is None else mass.data_ptr(), 0 if mass is None else mass.stride(0),
        0 if mass is None else mass.stride(1),
        n, hkv, q.shape[1] // hkv, q.shape[2], v_cache.shape[-1], k_cache.shape[1],
        float(scale), _DTYPES[q.dtype], torch.get_num_threads(), chunk or chunk_for(int(lens.sum())))
    if rc != 0:
        raise RuntimeError(f"the C decode-attention kernel rejected its arguments (code {rc})")
    return out
