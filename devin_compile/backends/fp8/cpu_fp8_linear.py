"""A C kernel for weight-only FP8 (e4m3fn) linears on CPU at a few rows (``cpu_fp8_linear.c``).

At decode a linear is a matrix-vector product bound by reading its weight: one byte a weight
here (half of bf16's). Layout (:func:`pack`): pairs of weight rows interleaved in 64-column
chunks, ``[ceil(N / 2), Kp / 64, 2, 64]`` uint8 (K padded to ``Kp``, a multiple of 64, and N to
even, with code 0), so a pair streams as one sequential read; one float32 scale a row. The kernel
decodes e4m3 inside the loop (AVX-512 VBMI: vpermi2b table lookups, 64 codes to bf16; AVX2/AVX-512:
the code's bits placed in a float16 and widened by F16C; portable: a 256-entry table), multiplies
each decoded chunk into every row of x of a tile (up to 8 rows on AVX-512, 4 on AVX2) with float32
FMAs (bf16 activations with AVX512-BF16: vdpbf16ps) and applies the row scale once per output.
Float32 sums: "dequantize, then an fp32 matmul" up to rounding order. Activations float32, bf16
or fp16; the output has x's dtype. The op's C++ kernel (:mod:`.cpu_fp8_op`) serves the per-step
calls; :func:`fp8_mm` is the Python path. The same kernel multiplies INT8 codes in the same layout
(``codes="int8"``: :mod:`devin_compile.backends.int8`), only its decoder differs.
"""
from __future__ import annotations

import ctypes

import torch

from ..native.build import CKernel

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGS = [_p, _i64, _i, _i, _i, _p, _p, _i, _p, _i64]  # x, x_stride, m, k, dtype, q, scale, n, out, out_stride

_KERNEL = CKernel("cpu_fp8_linear.c", {"devin_fp8_simd": [], "devin_fp8_linear": [*_ARGS, _i],
                                        "devin_fp8_linear_scalar": _ARGS, "devin_fp8_decode": [_p, _i, _p],
                                        "devin_int8_linear": [*_ARGS, _i], "devin_int8_linear_scalar": _ARGS})
CODES = ("e4m3", "int8")  # what a byte of the weight is


def load(variant: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel (``variant``: a key of :data:`~..native.build.VARIANTS`), building it
    the first time; None if it cannot be built here."""
    return _KERNEL.variant(variant).load()


def available() -> bool:
    return load() is not None


def simd(variant: str = "native") -> str:
    """The vector code a build runs: ``"avx512_vbmi"``, ``"avx512"``, ``"avx2"``, ``"portable"``
    (``"none"``: not built)."""
    lib = load(variant)
    return "none" if lib is None else ("portable", "avx2", "avx512", "avx512_vbmi")[lib.devin_fp8_simd()]


CHUNK = 64  # columns per chunk of the pair layout


def padded_k(k: int) -> int:
    return -(-k // CHUNK) * CHUNK


def pack(q: torch.Tensor) -> torch.Tensor:
    """Logical codes uint8 [N, K] → the kernel's pair layout uint8 [ceil(N/2), Kp·2] (zero padding)."""
    n, k = q.shape
    kp = padded_k(k)
    qp = torch.nn.functional.pad(q.to(torch.uint8), (0, kp - k, 0, n % 2))
    return qp.view(-1, 2, kp // CHUNK, CHUNK).transpose(1, 2).reshape(-1, 2 * kp).contiguous()


def unpack(qw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack` → uint8 [n, k]."""
    pairs, kp2 = qw.shape
    kp = kp2 // 2
    return qw.view(pairs, kp // CHUNK, 2, CHUNK).transpose(1, 2).reshape(2 * pairs, kp)[:n, :k]


def decode(q: torch.Tensor, variant: str = "native") -> torch.Tensor:
    """e4m3 codes (uint8, any shape) → float32 through the kernel's own decoder (tests)."""
    lib = load(variant)
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    lib.devin_fp8_decode(q.data_ptr(), q.numel(), out.data_ptr())
    return out


def fp8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int, scalar: bool = False,
           variant: str = "native", codes: str = "e4m3") -> torch.Tensor:
    """``x [..., K] @ (e4m3(q) · scale)ᵀ`` → [..., n] in x's dtype, ``q`` in :func:`pack`'s layout
    (``codes="int8"``: ``q`` holds int8 values, ``x @ (int8(q) · scale)ᵀ``).
    ``scalar``: the portable (table) path only; ``variant``: a build of
    :data:`~..native.build.VARIANTS` (tests)."""
    if codes not in CODES:
        raise ValueError(f"codes={codes!r} is unknown; valid: {list(CODES)}")
    lib = load(variant)
    if lib is None:
        raise RuntimeError(f"the C {codes} kernel is unavailable on this machine (see the log); use "
                           "kernel='reference'")
    if not x.is_contiguous():
        x = x.contiguous()
    k = x.shape[-1]
    if tuple(q.shape) != ((n + 1) // 2, 2 * padded_k(k)) or q.dtype != torch.uint8 or not q.is_contiguous():
        raise ValueError(f"{codes} cpu_c weight {q.dtype}{list(q.shape)} is not the packed layout of an [{n}, {k}] "
                         "weight (cpu_fp8_linear.pack)")
    m = x.numel() // k if k else 0
    out = x.new_empty((*x.shape[:-1], n))
    args = (x.data_ptr(), k, m, k, _DTYPES[x.dtype], q.data_ptr(), scale.data_ptr(), n, out.data_ptr(), n)
    entry = "devin_fp8_linear" if codes == "e4m3" else "devin_int8_linear"
    rc = getattr(lib, entry + "_scalar")(*args) if scalar else getattr(lib, entry)(*args, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the C {codes} kernel rejected its arguments (code {rc}): x {tuple(x.shape)}, "
                           f"q {tuple(q.shape)}")
    return out
