"""prepack_experts (CPU): MoE expert GEMMs → ``devin::grouped_linear`` over per-expert prepacked weights.

Pattern → replacement::

    transformers.grouped_mm_fallback(x, transpose(W, -2, -1), offs)      # W: [E, N, K] parameter
    →  devin.grouped_linear(x, offs, [packed(W[0]), …, packed(W[E-1])], N)

This is how HF's MoE experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek, … through
``integrations/moe.grouped_mm_experts_forward``) come out of export on CPU: tokens sorted by
expert, one ``mm`` per expert over a transposed view of the expert's weight. The replacement
runs the same per-expert GEMMs through oneDNN on weights re-laid out once
(``mkldnn._reorder_linear_weight``, batch hint 4: a decode step gives each expert a few rows),
1.3-2.4x faster per expert GEMM here at 2-64 rows (fp32, one thread). Values equal to fp32
rounding. Runs after :mod:`.fuse_moe_experts`, which takes float32 expert blocks whole; this pass
serves the ones it declines (and all of them with it off). Enabled with ``prepack_linear``
(experts are linears too); skipped off CPU or without
oneDNN for the dtype, and in the decode graph under ``compile_decode``. Packed copies are
shared by the prefill and decode graphs; the dense expert weights stay only where still read.
"""
from __future__ import annotations

import torch
import torch.fx

from .. import ops as _ops  # noqa: F401  (registers devin::grouped_linear)
from ..graph_utils import counted_nodes, is_call, node_delta
from ..pipeline import Pass, PassContext, PassResult, Program
from .dead_code import eliminate_dead_code
from .fuse_projections import _param
from .prepack_linear import PrepackLinear

aten = torch.ops.aten
_BATCH_HINT = 4


def _fallback_op():
    ns = getattr(torch.ops, "transformers", None)
    try:
        return ns.grouped_mm_fallback.default if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


class PrepackExperts(Pass):
    name = "prepack_experts"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        reason = PrepackLinear.skip_reason(self, program, ctx)  # the same CPU / oneDNN conditions
        if reason is not None:
            return reason
        target = _fallback_op()
        if target is None:
            return "transformers registers no grouped_mm_fallback op (no MoE experts to match)"
        if not any(is_call(n, target) for gm in program.graphs.values() for n in gm.graph.nodes):
            return "no MoE expert GEMMs in the graph"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        if phase == "decode" and ctx.config.compile_decode:
            return PassResult(note="decode graph left to Inductor (compile_decode)")
        target = _fallback_op()
        graph = gm.graph
        before = counted_nodes(gm)
        shared: dict[int, list[torch.Tensor]] = ctx.extras.setdefault("prepacked_experts", {})
        attrs: dict[int, list[str]] = {}
        count = 0
        for node in list(graph.nodes):
            if not is_call(node, target):
                continue
            x, wt, offs = node.args[:3]
            if not (is_call(wt, aten.transpose.int) and sorted(a % 3 for a in wt.args[1:3]) == [1, 2]):
                continue
            w = _param(gm, wt.args[0])
            if w is None or w.dim() != 3 or w.dtype != ctx.info.dtype or w.device.type != "cpu":
                continue
            if id(w) not in shared:
                shared[id(w)] = [torch.ops.mkldnn._reorder_linear_weight(w[e].detach().contiguous(), _BATCH_HINT)
                                 for e in range(w.shape[0])]
            if id(w) not in attrs:
                base = f"packed_experts_{len(attrs)}"
                for e, p in enumerate(shared[id(w)]):
                    gm.register_buffer(f"{base}_{e}", p, persistent=False)
                attrs[id(w)] = [f"{base}_{e}" for e in range(w.shape[0])]
            with graph.inserting_before(node):
                packed = []
                for name in attrs[id(w)]:
                    a = graph.get_attr(name)
                    a.meta["val"] = None
                    packed.append(a)
                new = graph.call_function(torch.ops.devin.grouped_linear.default, (x, offs, packed, int(w.shape[1])))
                new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            count += 1
        eliminate_dead_code(gm)
        return PassResult(matches=count, note=f"{count} expert GEMMs on {len(attrs)} packed expert sets; "
                                              f"{node_delta(gm, before)}")
