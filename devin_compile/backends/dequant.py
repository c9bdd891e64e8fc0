"""Dequantize blocks of 16 weight rows into a dense tile (``native/cpu_dequant.c``), for long steps.

A weight-only quantized linear's own kernel (INT4, FP8) streams its weight once per few rows of x,
so at prefill lengths a dense GEMM, which reuses each weight element across many rows, wins. Rather
than keep a dense copy of every quantized weight for those steps, a long step dequantizes its weight
a tile at a time into a reused buffer and runs the GEMM on that
(:func:`devin_compile.ops.dequant_tiles.tiled_linear`). This module is the dequantizer: it reads the
``cpu_c`` layouts of :mod:`.int4.cpu_int4_linear` and :mod:`.fp8.cpu_fp8_linear` and writes the
values torch's dequantization gives, bit for bit, in the activation dtype.

A tile is "transposed": weight rows ``16b .. 16b + 15`` become 16 consecutive values at each
column ``k``, at ``out + (b - b0) * block_stride + k * k_stride``; so ``block_stride = 16 K``,
``k_stride = 16`` is :func:`devin_compile.ops.packed_gemm_linear.pack_weight`'s layout, and
``block_stride = 16``, ``k_stride`` = the tile's columns is the weight transposed, ``[K, 16 nb]``.
"""
from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from .native.build import CKernel

ROWS = 16  # weight rows per block
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = CKernel("cpu_dequant.c", {
    "devin_int4_dequant": [_p, _p, _i, _i, _i, _i, _i, _i, _i, _p, _i64, _i64],
    "devin_fp8_dequant": [_p, _p, _i, _i, _i, _i, _i, _p, _i64, _i64]})


class Tiles(Protocol):
    """A quantized [n, k] weight that writes blocks of its rows into tiles."""

    n: int
    k: int

    def __call__(self, b0: int, nb: int, out: torch.Tensor, block_stride: int, k_stride: int) -> None:
        """Write blocks ``b0 .. b0 + nb - 1`` (rows ``16 b0 ..``, zeros past n) into ``out`` (its dtype)."""


def load(variant: str = "native") -> ctypes.CDLL | None:
    """The compiled dequantizer, building it the first time; None if it cannot be built here."""
    return _KERNEL.variant(variant).load()


def available() -> bool:
    return load() is not None


def _lib(variant: str) -> ctypes.CDLL:
    lib = load(variant)
    if lib is None:
        raise RuntimeError("the C dequantizer (cpu_dequant.c) is unavailable on this machine (see the log)")
    return lib


class Int4Tiles:
    """An INT4 weight in the ``cpu_c`` layout (qweight [NB, Kp·8] uint8, scales [NB, G, 2, 16] float32)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, n: int, k: int,
                 variant: str = "native") -> None:
        self.qweight, self.scales, self.group_size, self.n, self.k = qweight, scales, group_size, n, k
        self._lib = _lib(variant)

    def __call__(self, b0: int, nb: int, out: torch.Tensor, block_stride: int, k_stride: int) -> None:
        rc = self._lib.devin_int4_dequant(self.qweight.data_ptr(), self.scales.data_ptr(), self.n, self.k,
                                          self.scales.shape[1], self.group_size, b0, nb, _DTYPES[out.dtype],
                                          out.data_ptr(), block_stride, k_stride)
        if rc != 0:
            raise RuntimeError(f"the C dequantizer rejected an INT4 weight: qweight {tuple(self.qweight.shape)}, "
                               f"scales {tuple(self.scales.shape)}, n {self.n}, k {self.k}, blocks {b0}+{nb}")


class FP8Tiles:
    """An FP8 weight in the ``cpu_c`` pair layout (qweight [ceil(N/2), Kp·2] uint8, scale [N] float32)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, n: int, k: int, variant: str = "native") -> None:
        self.qweight, self.scale, self.n, self.k = qweight, scale, n, k
        self._lib = _lib(variant)

    def __call__(self, b0: int, nb: int, out: torch.Tensor, block_stride: int, k_stride: int) -> None:
        rc = self._lib.devin_fp8_dequant(self.qweight.data_ptr(), self.scale.data_ptr(), self.n, self.k, b0, nb,
                                         _DTYPES[out.dtype], out.data_ptr(), block_stride, k_stride)
        if rc != 0:
            raise RuntimeError(f"the C dequantizer rejected an FP8 weight: qweight {tuple(self.qweight.shape)}, "
                               f"n {self.n}, k {self.k}, blocks {b0}+{nb}")
