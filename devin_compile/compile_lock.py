"""One process-wide lock around tracing and compiling.

torch.export and Inductor patch process-wide settings (``torch._dynamo.config``,
``torch.fx.config``) while they run, so two of them must not overlap. A capture
(:func:`devin_compile.capture.capture`) and a background kernel compile
(:func:`devin_compile.backends.cpu_fused_decode.warm_up`) each hold this lock;
whichever comes second waits.
"""
from __future__ import annotations

import threading

TRACE_LOCK = threading.RLock()
