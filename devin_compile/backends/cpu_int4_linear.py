"""A C kernel for weight-only INT4 linears on CPU at a few rows (``cpu_int4_linear.c``).

At batch-1 decode a linear is a matrix-vector product whose time is reading its weight, so
4-bit weights can be ~4x faster than bf16 only if the kernel streams them at memory speed.
``aten._weight_int4pack_mm_for_cpu`` does not on this 2-core AVX2 CPU (SmolLM2's 120 decoder
linears at 1 token: ~9 ms, about 6 GB/s) and has no vectorised fp32-activation path; this
kernel turns 8 nibbles into 8 floats with an AND and a convert (no shuffles), scales per group
and reuses each unpacked weight for up to 4 rows of x (bench/quant.py ``--parts kernels`` has the figures).

Layout ("cpu_c" kernel of ``devin::int4_linear``; :func:`pack` builds it from the logical
format of :mod:`devin_compile.quant.int4`):

- ``qweight`` uint8 ``[N, Kq / 2]``, ``Kq`` = K padded to whole groups, then to a multiple of
  64: every 64 columns of a row are eight 32-bit lanes, lane ``i`` holding column ``8t + i`` in
  bits ``4t .. 4t + 3`` (so masking a lane set with ``0xF << 4t`` gives 8 consecutive columns
  without a shuffle; the C file says why that matters);
- ``scales`` float32 ``[N, G, 2]``: ``(scale, minv)``, so ``w = q * scale + minv``.

Group sizes 32, 64 and 128. Activations may be float32, bf16 or
fp16; the output has x's dtype. Float32 arithmetic, except that bf16/fp16 activations at one
row (batch-1 decode steps) are rounded per group to int16 (``dx = max|x| / 32767``, an error of at
most ``max|x| / 65534`` per element, below bf16's own rounding of the group's larger elements and
of the output) so that each group's ``Σ q·x`` is an exact integer sum (AVX2 ``madd``): ~1.5x the
float path's speed with the weights in cache, ~10% with them streamed from memory (the float path
spends one int→float convert and one FMA per 8 weights). :func:`int16_reference` is that
path's oracle; ``float_path=True`` forces the float path.
"""
from __future__ import annotations

import ctypes

import torch

from ..quant import int4 as fmt
from .c_build import CKernel

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i = ctypes.c_int
_ARGS = [_p, _i64, _i, _i, _i, _p, _p, _i, _i, _i, _p, _i64]  # x .. out_stride (shared by both entry points)


_KERNEL = CKernel("cpu_int4_linear.c", {"devin_int4_linear": [*_ARGS, _i], "devin_int4_linear_float": [*_ARGS, _i],
                                         "devin_int4_linear_scalar": _ARGS})


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it the first time; None if it cannot be built here."""
    return _KERNEL.load()


def available() -> bool:
    return load() is not None


def _units(k: int, group_size: int) -> int:
    return -(-fmt.padded_k(k, group_size) // 64)


def pack(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical int4 weight (q uint8 [N, K], scale/minv [N, G]) → (qweight, scales) of this kernel."""
    if group_size not in fmt.SUPPORTED_GROUP_SIZES:
        raise ValueError(f"the cpu_c int4 kernel takes group sizes {fmt.SUPPORTED_GROUP_SIZES}, got {group_size}")
    n, k = q.shape
    u = _units(k, group_size)
    qp = torch.nn.functional.pad(q.to(torch.uint8), (0, 64 * u - k)).view(n, u, 4, 2, 8)  # [n, unit, t//2, t%2, lane]
    lanes = qp[:, :, :, 0] | (qp[:, :, :, 1] << 4)  # [n, unit, byte of the lane, lane]
    packed = lanes.permute(0, 1, 3, 2).reshape(n, 32 * u).contiguous()
    return packed, torch.stack([scale.float(), minv.float()], dim=-1).contiguous()


def unpack(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack`'s nibble layout → uint8 [N, k]."""
    n, half = qweight.shape
    lanes = qweight.view(n, half // 32, 8, 4).permute(0, 1, 3, 2)  # [n, unit, byte, lane]
    q = torch.stack([lanes & 15, lanes >> 4], dim=3)  # [n, unit, byte, nibble, lane]
    return q.reshape(n, half * 2)[:, :k]


def int16_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Float32 oracle of the int16-activation path on the logical format (x [m, K]; q, scale,
    minv as :func:`pack` takes them): ``round16(x) @ (q·scale)ᵀ + x @ minvᵀ``, where round16
    rounds each group of x to ``dx · round(x / dx)``, ``dx = max|x| / 32767``, as the C code does."""
    m, k = x.shape
    kp = fmt.padded_k(k, group_size)
    xg = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, kp // group_size, group_size)
    dx = xg.abs().amax(dim=-1, keepdim=True) / 32767.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    xr = ((xg * inv).round().clamp(-32767, 32767) * dx).view(m, kp)[:, :k]
    qs = q.float() * scale.float().repeat_interleave(group_size, 1)[:, :k]
    return xr @ qs.t() + x.float() @ minv.float().repeat_interleave(group_size, 1)[:, :k].t()


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, n: int,
            scalar: bool = False, float_path: bool = False) -> torch.Tensor:
    """``x [..., K] @ dequant(W)ᵀ`` → [..., n] in x's dtype. ``scalar``: the portable path only
    (what machines without AVX2 run; tests compare the two); ``float_path``: never the int16
    activations. The op's C++ kernel (:mod:`.cpu_int4_op`) serves the per-step calls where it is
    built; this is the Python path."""
    lib = load()
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
