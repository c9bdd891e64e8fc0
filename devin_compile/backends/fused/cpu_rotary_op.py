"""Loads ``cpu_rotary_op.cpp``: a C++ CPU kernel for ``devin::rotary_heads``.

Per attention layer, a decode step otherwise dispatches ~20 small ops (view, transpose, roll,
mul, add, squeeze) of 1–15 µs each to split q/k/v into heads and rotate q and k; this kernel
does it in one pass for a few µs, bit-identical, and hands every call it does not serve back to
the op's Python kernel. Built like the other C++ op kernels (:class:`..native.build.TorchOpKernel`,
~10 s once, then cached); the pass :mod:`~devin_compile.passes.fuse_attention_inputs` loads it
through :func:`devin_compile.ops.rotary_heads.load_cpu_kernel` when it emits the op for a CPU graph.
"""
from __future__ import annotations

from ..native.build import TorchOpKernel

_KERNEL = TorchOpKernel("cpu_rotary_op.cpp", "devin_compile.ops.rotary_heads")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()
