"""Loads ``cpu_rms_norm_op.cpp``: a C++ CPU kernel for ``devin::rms_norm``.

aten's ``rms_norm`` is a composite on CPU (~9 dispatched ops, ~25 µs per call at one token on a
2-core CPU); this kernel does the row in one pass for a few µs and hands every call it does not
serve (non-contiguous x, a weight of another dtype) back to the op's Python kernel. Built like
the int4 op's kernel (:class:`..native.build.TorchOpKernel`, ~10 s once, then cached);
the pass :mod:`~devin_compile.passes.fuse_rms_norm` loads it through :func:`devin_compile.ops.rms_norm.load_cpu_kernel` when it emits the op for a CPU graph.
"""
from __future__ import annotations

from ..native.build import TorchOpKernel

_KERNEL = TorchOpKernel("cpu_rms_norm_op.cpp", "devin_compile.ops.rms_norm")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()
