"""Loads ``cpu_fp8_op.cpp``: a C++ CPU kernel for ``devin::fp8_linear``'s "cpu_c" calls (no Python
per call), built and cached like the INT4 one (:class:`..native.build.TorchOpKernel`). :func:`load`
is called when a "cpu_c" FP8 weight is prepared; without a C++ compiler the op's Python kernel
serves every call (the same results)."""
from __future__ import annotations

from ..native.build import TorchOpKernel

_KERNEL = TorchOpKernel("cpu_fp8_op.cpp", "devin_compile.ops.fp8_linear", c_source="cpu_fp8_linear.c")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()
