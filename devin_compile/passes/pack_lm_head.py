"""pack_lm_head (CPU, float32): the logits linear → ``devin::packed_linear`` over a weight packed once.

Pattern → replacement::

    linear(h, W_head[, b])  →  devin.packed_linear(h, pack_linear(W_head), b)     # W_head [V, H]

The logits linear is the one whose output reaches the graph output without another linear in
between. Both graphs compute it only at ``logits_indices`` (one row per sampling sequence), so it
always runs on a few rows over the largest weight of a small model (Mixtral-shaped bench: 32000 x
512, 65 MB of a decode step's ~165 MB at batch 1). oneDNN's GEMV reads it at about half the
memory bandwidth the op's C kernel reaches here (``cpu_packed_gemm.c``: each 16-column block
streamed once for all rows). Invariant: logits equal up to float32 summation order; the packed
weight is shared by the prefill and decode graphs (a tied embedding keeps its dense weight).
Declines (reason in the report): a head weight other than float32, V not a multiple of 16 or H
odd. Skipped off CPU, without a C/C++ compiler, and in the decode graph under ``compile_decode``.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import counted_nodes, node_delta
from ..ops import packed_linear as packed_op  # registers devin::packed_linear
from ..pipeline import Pass, PassContext, PassResult, Program
from .dead_code import eliminate_dead_code
from .fuse_projections import _param
from .offload_embeddings import _is_head


class PackLMHead(Pass):
    name = "pack_lm_head"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if ctx.info is not None and ctx.info.device.type != "cpu":
            return f"model is on {ctx.info.device.type}, not CPU"
        if not packed_op.load_cpu_kernel():
            return "the C++ kernel of devin::packed_linear cannot be built here (no C/C++ compiler)"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        if phase == "decode" and ctx.config.compile_decode:
            return PassResult(note="decode graph left to Inductor (compile_decode)")
        graph = gm.graph
        before = counted_nodes(gm)
        shared: dict[int, torch.Tensor] = ctx.extras.setdefault("packed_lm_head", {})
        count, declined = 0, []
        for node in [n for n in graph.nodes if _is_head(n)]:
            w = _param(gm, node.args[1])
            reason = "not a 2-D CPU parameter" if w is None or w.dim() != 2 or w.device.type != "cpu" \
                else packed_op.cpu_kernel_declines(w)
            if reason is not None:
                declined.append(f"{node.args[1].target}: {reason}")
                continue
            if id(w) not in shared:
                shared[id(w)] = packed_op.pack_linear(w)
            attr = f"packed_lm_head_{count}"
            gm.register_buffer(attr, shared[id(w)], persistent=False)
            bias = node.args[2] if len(node.args) > 2 else None
            with graph.inserting_before(node):
                a = graph.get_attr(attr)
                a.meta["val"] = None
                new = graph.call_function(torch.ops.devin.packed_linear.default, (node.args[0], a, bias))
                new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            count += 1
        eliminate_dead_code(gm)
        note = f"{count} logits linears packed; {node_delta(gm, before)}"
        if declined:
            note += "; declined: " + "; ".join(declined)
        return PassResult(matches=count, note=note)
