"""Loads ``cpu_int4_op.cpp``: a C++ CPU kernel for ``devin::int4_linear``'s "cpu_c" calls.

The op's Python kernel costs ~16 µs per call in dispatch and argument handling on a 2-core
CPU, against 15–70 µs of work for SmolLM2's linears at one token, and a decode step makes 120
calls. This C++ kernel (registered for the CPU dispatch key, so the dispatcher picks it over
the Python one) calls the C kernel directly and hands every call it does not serve back to the
Python kernel; the results are the same either way (tested).

Built with the system C++ compiler (``$CXX``, else ``c++``/``g++``) against torch's headers,
~10 s once, then cached like the C kernels (:mod:`.c_build`). :func:`load` is called when a
"cpu_c" weight is prepared; without a C++ compiler it logs why once and the Python kernel
serves every call.
"""
from __future__ import annotations

import logging
import threading

import torch

from . import c_build

log = logging.getLogger(__name__)

_state: dict[str, bool] = {}
_lock = threading.Lock()


def load() -> bool:
    """Register the C++ kernel (building it the first time); False if it cannot be built here."""
    if "loaded" in _state:
        return _state["loaded"]
    with _lock:
        if "loaded" in _state:
            return _state["loaded"]
        cc = c_build.find_compiler("CC", "cc", "gcc")
        cxx = c_build.find_compiler("CXX", "c++", "g++")
        try:
            if cc is None or cxx is None:
                raise RuntimeError("no C/C++ compiler found (set CC and CXX)")
            import devin_compile.ops.int4_linear  # noqa: F401  (the op must be defined before its kernels)

            path = c_build.build_torch_op(c_build.HERE / "cpu_int4_op.cpp", c_build.HERE / "cpu_int4_linear.c", cc,
                                          cxx)
            torch.ops.load_library(str(path))
            _state["loaded"] = True
        except Exception as e:  # noqa: BLE001  (no compiler, headers missing, ABI mismatch)
            log.warning("the C++ int4_linear kernel is unavailable (%s); the Python kernel serves every call", e)
            _state["loaded"] = False
        return _state["loaded"]
