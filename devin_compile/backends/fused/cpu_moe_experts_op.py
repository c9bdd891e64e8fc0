"""Loads ``cpu_moe_experts_op.cpp`` (linked with ``cpu_packed_gemm.c``): the float32 CPU kernel of
``devin::moe_experts``. Built like the other C++ op kernels (:class:`..native.build.TorchOpKernel`,
~10 s once, then cached); :func:`devin_compile.ops.moe_experts.load_cpu_kernel` loads it when the
pass :mod:`~devin_compile.passes.fuse_moe_experts` is about to emit the op.
"""
from __future__ import annotations

from ..native.build import TorchOpKernel

_KERNEL = TorchOpKernel("cpu_moe_experts_op.cpp", "devin_compile.ops.moe_experts", c_source="cpu_packed_gemm.c")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()
