"""Loads ``cpu_int4_op.cpp``: a C++ CPU kernel for ``devin::int4_linear``'s "cpu_c" calls.

The op's Python kernel costs ~16 µs per call in dispatch and argument handling on a 2-core
CPU, against 15–70 µs of work for SmolLM2's linears at one token, and a decode step makes 120
calls. This C++ kernel (registered for the CPU dispatch key, so the dispatcher picks it over
the Python one) calls the C kernel directly and hands every call it does not serve back to the
Python kernel; the results are the same either way (tested).

Built with the system C++ compiler (``$CXX``, else ``c++``/``g++``) against torch's headers,
~10 s once, then cached like the C kernels (:class:`..native.build.TorchOpKernel`). :func:`load` is
called when a "cpu_c" weight is prepared; without a C++ compiler it logs why once and the
Python kernel serves every call.
"""
from __future__ import annotations

from ..native.build import TorchOpKernel

_KERNEL = TorchOpKernel("cpu_int4_op.cpp", "devin_compile.ops.int4_linear", c_source="cpu_int4_linear.c")


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    return _KERNEL.load()
