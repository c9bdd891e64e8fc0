"""A C kernel for paged decode attention on CPU (``cpu_paged_decode.c``), built on first use.

Decode attention is memory-bound: each step reads every cached key and value once. The
torch paths around it pay for copies instead: gather + cast + SDPA reads and writes each
K/V row three times more, and an Inductor-generated kernel over the same gathers (used here
before this one) did not vectorise its indirect loads. Measured on this 2-core AVX2 CPU (bf16
pool, 24 sequences of 300–600 cached tokens, SmolLM2's 9 query / 3 KV heads of 64, one layer,
cache-warm): gather + SDPA 7.7–14 ms, the Inductor kernel 2.7 ms, this kernel 0.7 ms.

Built, cached and loaded by :mod:`..native.build` (the system C compiler, ``-O3 -march=native
-fopenmp``, ctypes); where no compiler works, :func:`load` returns None and callers keep
their torch path.

Contract of :func:`decode_attention`: ``q`` [T, Hq, D] (float32, bf16 or fp16, contiguous
in its last dim), caches [blocks, block_size, Hkv, D] in q's dtype, ``rows`` int64 [n] the
q/out row of each sequence, ``tables`` int32 [n, M] block tables, ``lens`` int32 [n] cached
keys (attends to slots ``0 .. lens[b]-1``; 0 gives zeros). Writes ``out[rows]`` ([T, Hq, Dv],
q's dtype), and optionally the attention mass per cached key (KV pruning's scores). Float32
arithmetic throughout.
"""
from __future__ import annotations

import ctypes

import torch

from ..native.build import CKernel, TorchOpKernel

CHUNK = 256  # most keys per task; fewer when the step has few keys, so every thread gets work
MIN_CHUNK = 32
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

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


_WRITE_ARGTYPES = [_p, _i64, _i64, _p, _i64, _i64, _p, _i,  # new k, v and their strides; slots, tokens
                   _p, _i64, _i64, _i64, _p, _i64, _i64, _i64,  # caches and strides
                   _i, _i, _i, _i, _i64, _i]  # Hkv, D, Dv, block_size, slots in the pool, element size


_KERNEL = CKernel("cpu_paged_decode.c", {"devin_paged_decode_attention": _ARGTYPES,
                                         "devin_paged_write_kv": _WRITE_ARGTYPES})


# cpu_decode_layer_op.cpp (these same C kernels linked in): devin::cpu_decode_layer, write_kv +
# decode_attention of one pure-decode layer in one dispatched call, and devin::paged_attention's
# C++ CPU kernel for pushed pure-decode steps (cpu_decode_step_push / _pop), for cpu_sdpa
_LAYER_OP = TorchOpKernel("cpu_decode_layer_op.cpp", "devin_compile.ops.paged_attention",
                          c_source="cpu_paged_decode.c")


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it the first time; None if it cannot be built here."""
    return _KERNEL.load()


def load_layer_op() -> bool:
    """Register ``devin::cpu_decode_layer``, the step push/pop ops and ``devin::paged_attention``'s
    C++ CPU kernel (building them the first time); False if they cannot be built."""
    return _LAYER_OP.load()


def decode_layer(q, k, v, k_cache, v_cache, slots, rows, tables, lens, scale: float, chunk: int) -> torch.Tensor:
    """:func:`write_kv` then :func:`decode_attention` into a new [T, Hq, Dv] (no ``mass``), in one
    C++ call (needs :func:`load_layer_op`); same contracts, checked in C++."""
    return torch.ops.devin.cpu_decode_layer(q, k, v, k_cache, v_cache, slots, rows, tables, lens, scale, chunk)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype == v_cache.dtype
            and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and q.shape[-1] <= 512 and v_cache.shape[-1] <= 512 and q.shape[1] // k_cache.shape[2] <= 32
            and q.shape[1] % k_cache.shape[2] == 0)


def write_supported(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`write_kv` takes these: CPU, one dtype throughout, rows contiguous in the last dim."""
    return (k.device.type == "cpu" and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.dim() == 3
            and k.shape[1:] == k_cache.shape[2:] and v.shape[1:] == v_cache.shape[2:]
            and k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Copy new rows k/v [T, Hkv, D] into the pools at flat ``slots`` (int64 [T]; -1: skip), in one
    C call (the torch path, :func:`~devin_compile.backends.attention.kv_write.write_kv`, makes four ops)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the C decode-attention kernel is unavailable on this machine (see the log)")
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == k.shape[0] == v.shape[0]
    rc = lib.devin_paged_write_kv(
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr(), k.shape[0],
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[2], k.shape[2], v.shape[2], k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1],
        k.element_size())
    if rc != 0:
        raise RuntimeError(f"KV write: a slot is outside the pool of {k_cache.shape[0] * k_cache.shape[1]} slots")


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
