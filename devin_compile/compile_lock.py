"""One process-wide lock around tracing and compiling.

torch.export and Inductor patch process-wide settings (``torch._dynamo.config``,
``torch.fx.config``) while they run, so two of them must not overlap. Every capture
(:func:`devin_compile.capture.capture`) holds this lock, so ``optimize()`` calls from
several threads (or a kernel compile started on another thread) take turns; whichever
comes second waits.
"""
from __future__ import annotations

import threading

TRACE_LOCK = threading.RLock()
