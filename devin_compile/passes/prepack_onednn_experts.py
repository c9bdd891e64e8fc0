"""prepack_onednn_experts (CPU): MoE expert GEMMs → ``devin::grouped_linear`` over oneDNN-prepacked experts.

Pattern → replacement::

    transformers.grouped_mm_fallback(x, transpose(W, -2, -1), offs)      # W: [E, N, K] parameter
    →  devin.grouped_linear(x, offs, [prepack_weight(W[0]), …, prepack_weight(W[E-1])], N)

This is how HF's MoE experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek, … through
``integrations/moe.grouped_mm_experts_forward``) come out of export on CPU: tokens sorted by
expert, one ``mm`` per expert over a transposed view of the expert's weight. The replacement
runs the same per-expert GEMMs through oneDNN on weights re-laid out once
(:func:`~devin_compile.ops.onednn_linear.prepack_weight`, batch hint 4: a decode step gives each expert a few rows),
1.3-2.4x faster per expert GEMM here at 2-64 rows (fp32, one thread). Values equal to fp32
rounding. Runs after :mod:`.fuse_moe_experts`, which takes float32 expert blocks whole; this pass
serves the ones it declines (and all of them with it off). Enabled by ``prepack_linear``
(experts are linears too); skipped off CPU or without
oneDNN for the dtype, and in the decode graph under ``compile_decode``. Packed copies are
shared by the prefill and decode graphs; the dense expert weights stay only where still read.
"""
from __future__ import annotations

import torch
import torch.fx

from .. import ops as _ops  # noqa: F401  (registers devin::grouped_linear)
from ..graph_utils import (add_constant, counted_nodes, eliminate_dead_code, grouped_mm_fallback_op, has_call, is_call,
                           node_delta, swap_call, transposed_expert_weight)
from ..ops.onednn_linear import onednn_declines, prepack_weight
from ..pipeline import Pass, PassContext, PassResult, Program

_BATCH_HINT = 4


class PrepackOneDNNExperts(Pass):
    name = "prepack_onednn_experts"
    leaves_compiled_decode = "decode graph left to Inductor (compile_decode)"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        reason = onednn_declines(ctx.info.device, ctx.info.dtype)
        if reason is not None:
            return reason
        target = grouped_mm_fallback_op()
        if target is None:
            return "transformers registers no grouped_mm_fallback op (no MoE experts to match)"
        if not has_call(program.graphs.values(), target):
            return "no MoE expert GEMMs in the graph"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        target = grouped_mm_fallback_op()
        graph = gm.graph
        before = counted_nodes(gm)
        attrs: dict[int, list[str]] = {}  # expert weight → its packed experts' buffer names in this graph
        count = 0
        for node in [n for n in graph.nodes if is_call(n, target)]:
            x, wt, offs = node.args[:3]
            w = transposed_expert_weight(gm, wt)
            if w is None or w.dtype != ctx.info.dtype or w.device.type != "cpu":
                continue
            experts = ctx.shared_weights.get(self.name, (w,), lambda: [prepack_weight(w[e], _BATCH_HINT)
                                                                       for e in range(w.shape[0])])
            names = attrs.setdefault(id(w), [f"packed_experts_{len(attrs)}_{e}" for e in range(w.shape[0])])
            with graph.inserting_before(node):
                packed = [add_constant(gm, name, p) for name, p in zip(names, experts)]
            swap_call(graph, node, torch.ops.devin.grouped_linear.default, (x, offs, packed, int(w.shape[1])))
            count += 1
        eliminate_dead_code(gm)
        return PassResult(matches=count, note=f"{count} expert GEMMs on {len(attrs)} packed expert sets; "
                                              f"{node_delta(gm, before)}")
