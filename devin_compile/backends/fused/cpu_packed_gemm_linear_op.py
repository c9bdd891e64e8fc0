"""Loads ``cpu_packed_gemm_linear_op.cpp`` (linked with ``cpu_packed_gemm.c``): the float32 CPU kernel of
``devin::packed_gemm_linear``. Built like the other C++ op kernels (:class:`..native.build.TorchOpKernel`,
~10 s once, then cached); :func:`devin_compile.ops.packed_gemm_linear.load_cpu_kernel` loads it when the
pass :mod:`~devin_compile.passes.pack_gemm_linears` is about to emit the op.
"""
from __future__ import annotations

from ..native.build import TorchOpKernel, cpu_flags

_KERNEL = TorchOpKernel("cpu_packed_gemm_linear_op.cpp", "devin_compile.ops.packed_gemm_linear",
                        c_source="cpu_packed_gemm.c")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()


def tile_rows() -> int:
    """Rows per register tile of the kernel built here (``MR`` in ``cpu_packed_gemm.c``): 8 where
    ``-march=native`` enables AVX-512 (32 vector registers), else 2."""
    return 8 if "avx512f" in cpu_flags().split() else 2


def bf16_pairs() -> bool:
    """Whether the kernel built here takes bf16 weights (in pairs): ``-march=native`` enables AVX512-BF16."""
    return "avx512_bf16" in cpu_flags().split()
