"""upcast_linear (CPU, bf16/fp16 without native oneDNN support): many-row linears in float32.

Pattern → replacement::

    linear(x, W[, b])  →  upcast_linear(x, W, b, min_rows)

for every linear whose weight is a bf16/fp16 CPU parameter, on CPUs where oneDNN has no
native kernel for that dtype (there ``prepack_onednn_linears`` applies instead and this pass
skips). :func:`devin_compile.ops.upcast_linear.upcast_linear` keeps the half-precision
linear below ``min_rows`` rows and computes in float32 above it (3–7x faster GEMMs here at
8–256 rows: prefill, batched decode). Invariants: same output shape and dtype as the linear
it replaces (the node's metadata is kept), weights untouched and shared between graphs. With
``compile_decode`` the decode graph is left to Inductor.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import cpu_linears, swap_call
from ..ops.onednn_linear import onednn_supports
from ..ops.upcast_linear import LeafTracer, upcast_linear
from ..pipeline import Pass, PassContext, PassResult, Program

MIN_ROWS = 8  # measured crossover on this CPU: equal at 4 rows, 1.7x (layers) / 1.8x (lm_head) at 8


class UpcastLinear(Pass):
    name = "upcast_linear"
    leaves_compiled_decode = "decode graph left to compile_decode"

    def __init__(self, min_rows: int = MIN_ROWS) -> None:
        super().__init__()
        self.min_rows = min_rows

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        info = ctx.info
        if info.device.type != "cpu":
            return f"model is on {info.device.type}, not CPU"
        if info.dtype not in (torch.bfloat16, torch.float16):
            return f"{info.dtype} linears already run at full speed"
        if onednn_supports(info.dtype):
            return f"this CPU has native oneDNN {info.dtype} linears (prepack_onednn_linears uses them)"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        graph = gm.graph
        count = 0
        for node, _w, bias in cpu_linears(gm, (torch.bfloat16, torch.float16)):
            swap_call(graph, node, upcast_linear, (node.args[0], node.args[1], bias, self.min_rows))
            count += 1
        if count:  # the compile cache unpickles the graph, and FX re-traces it: keep the call a leaf
            graph._tracer_cls = gm._tracer_cls = LeafTracer
        return PassResult(matches=count, note=f"{count} linears upcast to float32 from {self.min_rows} rows")
