"""prepack_onednn_linears (CPU): dense linears → oneDNN linears over weights prepacked once.

Pattern → replacement::

    linear(x, W[, b])  →  mkldnn._linear_pointwise(x, prepack_weight(W), b, "none")

``W`` must be a float parameter on the CPU. The weight is re-laid out once at compile
time into oneDNN's blocked format (:mod:`~devin_compile.ops.onednn_linear`; the same thing
Inductor's freezing does), so each step's GEMM/GEMV skips the per-call reorder that
``aten.linear`` pays. On this machine that is 1.5-3x faster per linear in bf16 at one token,
bit-identical in bf16, and equal to fp32 rounding in fp32. The packed weight replaces the
dense one (a weight still read elsewhere, e.g. an embedding tied to lm_head, is kept as well).
Skipped (with the reason in the report) off CPU or without oneDNN. The prefill and decode
graphs share weights, and share each packed copy too (packed once per program); with
``compile_decode`` the decode graph stays dense for Inductor, which packs it itself. Enabled by
``prepack_linear``; runs after ``pack_gemm_linears``, which takes the linears its kernel serves.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import add_constant, counted_nodes, cpu_linears, eliminate_dead_code, node_delta, swap_call
from ..ops.onednn_linear import onednn_declines, onednn_linear_args, onednn_linear_op, prepack_weight
from ..pipeline import Pass, PassContext, PassResult, Program


class PrepackOneDNNLinears(Pass):
    name = "prepack_onednn_linears"
    leaves_compiled_decode = "decode graph left dense: compile_decode packs its weights (Inductor freezing)"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        return onednn_declines(ctx.info.device, ctx.info.dtype)

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        graph = gm.graph
        before = counted_nodes(gm)
        packed: dict[str, str] = {}  # dense attr → packed attr (a weight read twice is registered once)
        count = 0
        for node, w, bias in cpu_linears(gm):
            w_node = node.args[1]
            attr = packed.setdefault(w_node.target, f"packed_{len(packed)}_" + w_node.target.replace(".", "_"))
            weight = ctx.shared_weights.get(self.name, (w,), lambda: prepack_weight(w))
            with graph.inserting_before(node):  # shape/dtype of the dense weight, for dumps
                wp = add_constant(gm, attr, weight, w_node.meta.get("val"))
            swap_call(graph, node, onednn_linear_op(), onednn_linear_args(node.args[0], wp, bias))
            count += 1
        eliminate_dead_code(gm)
        return PassResult(matches=count,
                          note=f"{count} linears on {len(packed)} packed weights; {node_delta(gm, before)}")
