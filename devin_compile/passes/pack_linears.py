"""pack_linears (CPU, float32): linears → ``devin::packed_linear`` over weights packed once.

Pattern → replacement::

    linear(x, W[N, K][, b])  →  devin.packed_linear(x, pack_linear(W), b, N)   # W packed as [⌈N/16⌉, K, 16]

Which linears: the logits linear (the one whose output reaches the graph output with no other
linear between) on any CPU: both graphs compute it only at ``logits_indices``, so it always runs
on a few rows over the largest weight of a small model (the Mixtral-shaped bench: 32000 x 512,
65 MB of a decode step's ~165 MB at batch 1), where oneDNN's GEMV reads at about half the memory
bandwidth of the op's C kernel here. Every other float32 linear too where that kernel's register
tile holds 8 rows (AVX-512): there it is as fast as oneDNN's prepacked GEMM from 16 to 512 rows
and about twice as fast at decode rows (the bench's attention projections: ~20 vs ~40 µs at one
row); with the 2-row AVX2 tile those stay for ``prepack_linear``.

Invariant: outputs equal up to float32 summation order, and a row's result does not depend on
the other rows of the step; packed weights are shared by the prefill and decode graphs and
replace the dense ones (a tied embedding keeps its dense weight). Declines (reason in the
report): weights other than float32 CPU parameters, K odd. Skipped off
CPU, without a C/C++ compiler, and in the decode graph under ``compile_decode`` (Inductor).
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import counted_nodes, is_call, node_delta
from ..ops import packed_linear as packed_op  # registers devin::packed_linear
from ..pipeline import Pass, PassContext, PassResult, Program
from .dead_code import eliminate_dead_code
from .fuse_projections import _param
from .offload_embeddings import _is_head

aten = torch.ops.aten


class PackLinears(Pass):
    name = "pack_linears"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if ctx.info is not None and ctx.info.device.type != "cpu":
            return f"model is on {ctx.info.device.type}, not CPU"
        if ctx.info is not None and ctx.info.dtype != torch.float32:
            return f"the kernel computes float32; {ctx.info.dtype} linears are prepack_linear's"
        if not packed_op.load_cpu_kernel():
            return "the C++ kernel of devin::packed_linear cannot be built here (no C/C++ compiler)"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        if phase == "decode" and ctx.config.compile_decode:
            return PassResult(note="decode graph left to Inductor (compile_decode)")
        graph = gm.graph
        before = counted_nodes(gm)
        shared: dict[int, torch.Tensor] = ctx.extras.setdefault("packed_linears", {})
        every = packed_op.serves_many_rows()
        count, heads, declined = 0, 0, []
        for node in [n for n in graph.nodes if is_call(n, aten.linear.default)]:
            head = _is_head(node)
            if not (head or every):
                continue
            w = _param(gm, node.args[1])
            reason = "not a 2-D CPU parameter" if w is None or w.dim() != 2 or w.device.type != "cpu" \
                else packed_op.cpu_kernel_declines(w)
            if reason is not None:
                if head or w is None or w.dtype == torch.float32:  # other dtypes are prepack_linear's
                    declined.append(f"{getattr(node.args[1], 'target', node.args[1])}: {reason}")
                continue
            if id(w) not in shared:
                shared[id(w)] = packed_op.pack_linear(w)
            attr = f"packed_linear_{count}"
            gm.register_buffer(attr, shared[id(w)], persistent=False)
            bias = node.args[2] if len(node.args) > 2 else None
            with graph.inserting_before(node):
                a = graph.get_attr(attr)
                a.meta["val"] = None
                new = graph.call_function(torch.ops.devin.packed_linear.default,
                                          (node.args[0], a, bias, int(w.shape[0])))
                new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            count += 1
            heads += head
        eliminate_dead_code(gm)
        note = f"{count} linears packed ({heads} logits); {node_delta(gm, before)}"
        if not every:
            note += "; other linears left to prepack_linear (the kernel's AVX2 tile holds 2 rows)"
        if declined:
            note += "; left to prepack_linear: " + "; ".join(declined)
        return PassResult(matches=count, note=note)
