"""``upcast_linear``: a bf16/fp16 linear computed in float32 when the step has enough rows.

On CPUs whose oneDNN has no native bf16 (AVX2 machines: no AVX-512-BF16, AMX or
AVX-NE-CONVERT), ``aten.linear`` in bf16 is compute-bound at ~19 GFLOP/s, while float32
GEMMs reach ~100. Measured here (2 threads, SmolLM2 shapes, bf16 in and out):

=========================  =======  =======  =======
rows                            4        8       64
=========================  =======  =======  =======
576→1536, bf16 linear      0.51 ms  0.73 ms  5.9 ms
576→1536, this function    0.36 ms  0.42 ms  1.2 ms
lm_head 576→49152, bf16     11.6 ms  23.5 ms  185 ms
lm_head, this function     10.9 ms  13.0 ms   32 ms
=========================  =======  =======  =======

With fewer than ``min_rows`` rows (batch-1 decode) the bf16 linear is faster: it reads half
the bytes, and bandwidth is the limit there. Above it, the input is cast to float32 once and
the weight in chunks of :data:`CHUNK_ROWS` output rows (~4.5 MB of float32: the chunk stays in
cache, so the cast costs little and no float32 copy of the weights is kept); the result is
rounded back to the input dtype. Float32 accumulation is what the bf16 kernel does too, so
only the summation order differs.

A plain function, not a ``devin::`` op: it is called ~120 times per step, and a Python custom
op's dispatch costs ~20 µs a call here against ~0.5 µs for a function call in the FX code.
Graphs that hold it are not traced further (``compile_decode`` keeps the decode graph dense), except
by FX when the compile cache unpickles them: FX re-traces the graph's code, and :class:`LeafTracer`
(set on such graphs by the ``upcast_linear`` pass) keeps the function one call instead of tracing into
its branch on the row count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ROWS = 2048


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  min_rows: int = 8) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows < min_rows:
        return F.linear(x, weight, bias)
    n = weight.shape[0]
    xf = x.reshape(rows, k).float()
    out = x.new_empty((rows, n))
    for i in range(0, n, CHUNK_ROWS):
        b = None if bias is None else bias[i:i + CHUNK_ROWS].float()
        out[:, i:i + CHUNK_ROWS] = F.linear(xf, weight[i:i + CHUNK_ROWS].float(), b)
    return out.view(*x.shape[:-1], n)


class LeafTracer(torch.fx.Tracer):
    """The tracer FX runs when it unpickles a graph that calls :func:`upcast_linear` (``graph._tracer_cls``):
    the function stays a leaf ``call_function`` node (its branch on the row count cannot be traced)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("autowrap_functions", (upcast_linear,))
        super().__init__(*args, **kwargs)
