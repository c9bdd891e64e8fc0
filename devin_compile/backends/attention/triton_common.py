"""What the Triton attention kernels share: whether triton imports, interpreter mode, block sizes.

Triton is imported lazily-safe: without triton (or with a broken install) this module still
imports, ``HAVE_TRITON`` is False and ``triton``/``tl`` are None.
"""
from __future__ import annotations

import math
import os

try:  # pragma: no cover - exercised by whether triton is installed
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken triton install
    triton = None
    tl = None
    HAVE_TRITON = False


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter: slow, meant for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int, floor: int = 16) -> int:
    """The next power of two >= n, at least ``floor`` (Triton block sizes)."""
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
