"""Loads ``cpu_packed_linear_op.cpp`` (linked with ``cpu_packed_gemm.c``): the float32 CPU kernel of
``devin::packed_linear``. Built like the other C++ op kernels (:class:`..native.build.TorchOpKernel`,
~10 s once, then cached); :func:`devin_compile.ops.packed_linear.load_cpu_kernel` loads it when the
pass :mod:`~devin_compile.passes.pack_lm_head` is about to emit the op.
"""
from __future__ import annotations

from ..native.build import TorchOpKernel

_KERNEL = TorchOpKernel("cpu_packed_linear_op.cpp", "devin_compile.ops.packed_linear", c_source="cpu_packed_gemm.c")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()
