"""Loads ``cpu_silu_mul_op.cpp``: a C++ CPU kernel for ``devin::silu_mul`` (the same aten calls
as the op's Python kernel, without their Python dispatch). Built like the other C++ op kernels
(:class:`..native.build.TorchOpKernel`, ~10 s once, then cached); the pass :mod:`~devin_compile.passes.fuse_silu_mul`
loads it through :func:`devin_compile.ops.silu_mul.load_cpu_kernel` when it emits the op for a CPU graph.
"""
from __future__ import annotations

from ..native.build import TorchOpKernel

_KERNEL = TorchOpKernel("cpu_silu_mul_op.cpp", "devin_compile.ops.silu_mul")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()
