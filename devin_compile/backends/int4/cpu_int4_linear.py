"""A C kernel for weight-only INT4 linears on CPU at a few rows (``cpu_int4_linear.c``).

At batch-1 decode a linear is a matrix-vector product: its time is reading the weight plus
turning nibbles into numbers, and on a CPU the second is what a naive kernel is bound by.
This kernel interleaves weight rows in blocks of 16, so one vector holds the same 8 columns of
16 rows (as nibbles) and its lanes accumulate 16 outputs: no shuffles, no horizontal sums.

Layout ("cpu_c" kernel of ``devin::int4_linear``; :func:`pack` builds it from the logical
format of :mod:`devin_compile.backends.int4.format`):

- ``qweight`` uint8 ``[NB, Kp · 8]``, ``NB = ceil(N / 16)``, ``Kp`` = K padded to whole groups:
  block b, chunk c (64 bytes) holds 4 bytes per row r of the block, byte j's low nibble column
  ``8c + j`` and its high nibble column ``8c + 4 + j`` of row ``16b + r`` (rows past N are 0);
- ``scales`` float32 ``[NB, G, 2, 16]``: per block and group, the 16 rows' scales, then their
  minimums, so ``w = q * scale + minv``.

Group sizes 32, 64 and 128. Activations may be float32, bf16 or fp16; the output has x's dtype.
Two paths, each with AVX-512 and AVX2 code (and a portable one elsewhere):

- **integer** (bf16/fp16 activations): each group of x is rounded to int16 (``dx = max|x| /
  32639``, an error of at most ``max|x| / 65278`` per element, below bf16's own rounding of the
  group's larger elements and of the output) and split into two signed bytes, so each group's
  ``Σ q·x`` is an exact integer sum of u8 × s8 products (AVX-512 VNNI ``vpdpbusd``, AVX2
  ``vpmaddubsw``); :func:`int16_reference` is its oracle;
- **float** (float32 activations, or ``float_path=True``): an AND, a convert and an FMA per
  16 weights, float32 arithmetic: "dequantize, then an fp32 matmul" up to rounding order.

Each loaded chunk serves up to 4 rows of x. ``bench/quant.py --parts kernels`` has the figures.
"""
from __future__ import annotations

import ctypes

import torch

from . import format as fmt
from ..native.build import VARIANTS, CKernel  # noqa: F401  (VARIANTS: re-exported for tests)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i = ctypes.c_int
_ARGS = [_p, _i64, _i, _i, _i, _p, _p, _i, _i, _i, _p, _i64]  # x .. out_stride (shared by both entry points)
X16_MAX = 32639  # the integer path's int16 range: 127 · 256 + 127, so both bytes of x16 are signed bytes


_KERNEL = CKernel("cpu_int4_linear.c", {"devin_int4_simd": [], "devin_int4_linear": [*_ARGS, _i],
                                         "devin_int4_linear_float": [*_ARGS, _i],
                                         "devin_int4_linear_scalar": _ARGS})


def load(variant: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel (``variant``: a key of :data:`~..native.build.VARIANTS`), building it
    the first time; None if it cannot be built here."""
    return _KERNEL.variant(variant).load()


def available() -> bool:
    return load() is not None


def simd() -> str:
    """The vector code the native build runs: ``"avx512"``, ``"avx2"`` or ``"portable"`` (or
    ``"none"``: not built here)."""
    lib = load()
    return "none" if lib is None else ("portable", "avx2", "avx512")[lib.devin_int4_simd()]


ROWS = 16  # weight rows per interleaved block


def pack(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical int4 weight (q uint8 [N, K], scale/minv [N, G]) → (qweight [NB, Kp·8], scales
    [NB, G, 2, 16]) of this kernel, ``NB = ceil(N / 16)``, rows past N zero."""
    if group_size not in fmt.SUPPORTED_GROUP_SIZES:
        raise ValueError(f"the cpu_c int4 kernel takes group sizes {fmt.SUPPORTED_GROUP_SIZES}, got {group_size}")
    n, k = q.shape
    kp = fmt.padded_k(k, group_size)
    pad_n = -n % ROWS
    nb = (n + pad_n) // ROWS
    qp = torch.nn.functional.pad(q.to(torch.uint8), (0, kp - k, 0, pad_n))
    t = qp.view(nb, ROWS, kp // 8, 2, 4)  # [block, row, chunk, low/high nibble, byte]
    chunks = (t[:, :, :, 0] | (t[:, :, :, 1] << 4)).permute(0, 2, 1, 3)  # [block, chunk, row, byte]
    sz = torch.nn.functional.pad(torch.stack([scale.float(), minv.float()], dim=-1), (0, 0, 0, 0, 0, pad_n))
    return (chunks.reshape(nb, kp * 8).contiguous(),
            sz.view(nb, ROWS, -1, 2).permute(0, 2, 3, 1).contiguous())  # [block, group, scale/minv, row]


def unpack(qweight: torch.Tensor, k: int, n: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`'s nibble layout → uint8 [n, k] (n: all rows, padding included, if None)."""
    nb, kp8 = qweight.shape
    chunks = qweight.view(nb, kp8 // 64, ROWS, 4).permute(0, 2, 1, 3)  # [block, row, chunk, byte]
    q = torch.stack([chunks & 15, chunks >> 4], dim=3)  # [block, row, chunk, nibble, byte]
    return q.reshape(nb * ROWS, kp8 // 8)[:n, :k]


def unpack_scales(scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack`'s scales → (scale, minv), each float32 [n, G]."""
    nb, g = scales.shape[:2]
    rows = scales.permute(0, 3, 1, 2).reshape(nb * ROWS, g, 2)[:n]
    return rows[..., 0], rows[..., 1]


def int16_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Float32 oracle of the integer path on the logical format (x [m, K]; q, scale, minv as
    :func:`pack` takes them): ``round16(x) @ (q·scale)ᵀ + x @ minvᵀ``, where round16 rounds each
    group of x to ``dx · round(x / dx)``, ``dx = max|x| / X16_MAX``, as the C code does."""
    m, k = x.shape
    kp = fmt.padded_k(k, group_size)
    xg = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, kp // group_size, group_size)
    dx = xg.abs().amax(dim=-1, keepdim=True) / X16_MAX
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    xr = ((xg * inv).round().clamp(-X16_MAX, X16_MAX) * dx).view(m, kp)[:, :k]
    qs = q.float() * scale.float().repeat_interleave(group_size, 1)[:, :k]
    return xr @ qs.t() + x.float() @ minv.float().repeat_interleave(group_size, 1)[:, :k].t()


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, n: int,
            scalar: bool = False, float_path: bool = False, variant: str = "native") -> torch.Tensor:
    """``x [..., K] @ dequant(W)ᵀ`` → [..., n] in x's dtype. ``scalar``: the portable path only
    (what machines without AVX2 run; tests compare the two); ``float_path``: never the integer
    path. The op's C++ kernel (:mod:`.cpu_int4_op`) serves the per-step calls where it is
    built; this is the Python path. ``variant``: a build of :data:`VARIANTS` (tests)."""
    lib = load(variant)
    if lib is None:
        raise RuntimeError("the C int4 kernel is unavailable on this machine (see the log); use kernel='cpu'")
    if not x.is_contiguous():
        x = x.contiguous()
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    out = x.new_empty((*x.shape[:-1], n))
    args = (x.data_ptr(), k, m, k, _DTYPES[x.dtype], qweight.data_ptr(), scales.data_ptr(), n, scales.shape[1],
            group_size, out.data_ptr(), n)
    if scalar:
        rc = lib.devin_int4_linear_scalar(*args)
    else:
        rc = (lib.devin_int4_linear_float if float_path else lib.devin_int4_linear)(*args, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the C int4 kernel rejected its arguments (code {rc}): x {tuple(x.shape)}, "
                           f"qweight {tuple(qweight.shape)}, group size {group_size}")
    return out
