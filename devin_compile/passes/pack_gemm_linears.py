"""pack_gemm_linears (CPU, float32; bf16 tied heads): linears → ``devin::packed_gemm_linear``, weights packed once.

Pattern → replacement::

    linear(x, W[N, K][, b])  →  devin.packed_gemm_linear(x, pack_weight(W), b, N)   # W packed as [⌈N/16⌉, K, 16]

Which linears: the logits linear (the one whose output reaches the graph output with no other
linear between) on any CPU: both graphs compute it only at ``logits_indices``, so it always runs
on a few rows over the largest weight of a small model (the Mixtral-shaped bench: 32000 x 512,
65 MB of a decode step's ~165 MB at batch 1), where oneDNN's GEMV reads at about half the memory
bandwidth of the op's C kernel here. Every other float32 linear too where that kernel's register
tile holds 8 rows (AVX-512): there it is as fast as oneDNN's prepacked GEMM from 16 to 512 rows
and about twice as fast at decode rows (the bench's attention projections: ~20 vs ~40 µs at one
row); with the 2-row AVX2 tile those stay for ``prepack_onednn_linears``. In a bf16 model, on CPUs with
AVX512-BF16, only an output head tied to the embedding (its packed copy then serves both, where a
oneDNN-prepacked head would sit beside the dense embedding; at one row as fast as oneDNN's GEMV; on AMX
CPUs its whole 16-row tiles go through AMX, 64 rows of SmolLM2's head in 3.3 ms instead of ~20);
the other bf16 linears are ``prepack_onednn_linears'``. Enabled by ``pack_linears``.

Invariant: outputs equal up to float32 summation order, and a float32 row's result does not depend on
the other rows of the step (a bf16 row's rounding follows its tile: AMX or AVX512-BF16); packed weights are shared by the prefill and decode graphs and
replace the dense ones. An embedding tied to a packed head reads its rows from the packed weight
(``devin::packed_embedding``, the same values), so the dense weight is dropped too: each weight is
held once. Declines (reason in the report): weights other than float32 (bf16 tied heads) CPU parameters, K odd.
Skipped off CPU, without a C/C++ compiler, and in the decode graph under ``compile_decode``
(Inductor; the decode graph then keeps the dense head and embedding).
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import (add_constant, counted_nodes, eliminate_dead_code, is_call, is_logits_linear, linear_bias,
                           node_delta, param_of, swap_call)
from ..ops import packed_gemm_linear as packed_op  # registers devin::packed_gemm_linear
from ..pipeline import Pass, PassContext, PassResult, Program

aten = torch.ops.aten


class PackGemmLinears(Pass):
    name = "pack_gemm_linears"
    leaves_compiled_decode = "decode graph left to Inductor (compile_decode)"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if ctx.info is not None and ctx.info.device.type != "cpu":
            return f"model is on {ctx.info.device.type}, not CPU"
        if ctx.info is not None and ctx.info.dtype not in (torch.float32, torch.bfloat16):
            return f"the kernel computes float32 (and bf16 tied heads); {ctx.info.dtype} linears are " \
                   "prepack_onednn_linears'"
        if not packed_op.load_cpu_kernel():
            return "the C++ kernel of devin::packed_gemm_linear cannot be built here (no C/C++ compiler)"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        graph = gm.graph
        before = counted_nodes(gm)
        every = packed_op.serves_many_rows()
        count, heads, tied, declined = 0, 0, 0, []
        for node in [n for n in graph.nodes if is_call(n, aten.linear.default)]:
            head = is_logits_linear(node)
            w = param_of(gm, node.args[1])
            if not _wanted(gm, w, head, every):
                continue
            reason = "not a 2-D CPU parameter" if w is None or w.dim() != 2 or w.device.type != "cpu" \
                else packed_op.cpu_kernel_declines(w)
            if reason is not None:
                if head or w is None or w.dtype == torch.float32:  # other dtypes are prepack_onednn_linears'
                    declined.append(f"{getattr(node.args[1], 'target', node.args[1])}: {reason}")
                continue
            packed = ctx.shared_weights.get(self.name, (w,), lambda: packed_op.pack_weight(w))
            with graph.inserting_before(node):
                attr = add_constant(gm, f"packed_gemm_{count}", packed)
            swap_call(graph, node, torch.ops.devin.packed_gemm_linear.default,
                      (node.args[0], attr, linear_bias(node), int(w.shape[0])))
            count += 1
            heads += head
            if head:
                tied += _read_embedding_from(gm, w, attr)
        eliminate_dead_code(gm)
        note = f"{count} linears packed ({heads} logits); {node_delta(gm, before)}"
        if tied:
            note += f"; {tied} tied embedding reads the packed head"
        if not every:
            note += "; other linears left to prepack_onednn_linears (the kernel's AVX2 tile holds 2 rows)"
        if declined:
            note += "; left to prepack_onednn_linears: " + "; ".join(declined)
        return PassResult(matches=count, note=note)


def _wanted(gm: torch.fx.GraphModule, w: torch.Tensor | None, head: bool, every: bool) -> bool:
    """Whether to pack this linear: float32 heads, other float32 linears where the tile holds 8 rows, and a
    bf16 head only where an embedding reads its weight too (tied) and the kernel takes bf16 (AVX512-BF16)."""
    if w is not None and w.dtype == torch.bfloat16:
        return head and packed_op.serves_bf16() and any(
            is_call(n, aten.embedding.default) and param_of(gm, n.args[0]) is w for n in gm.graph.nodes)
    return head or every


def _read_embedding_from(gm: torch.fx.GraphModule, w: torch.Tensor, packed: torch.fx.Node) -> int:
    """Embedding lookups of ``w`` (the head's dense weight, tied) → ``devin::packed_embedding`` of its packed
    copy ``packed``; returns how many were rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        # (embedding's other arguments, padding_idx and the gradient flags, do not change its forward)
        if is_call(node, aten.embedding.default) and param_of(gm, node.args[0]) is w:
            with gm.graph.inserting_before(node):
                rows = gm.graph.get_attr(packed.target)
                rows.meta["val"] = packed.meta.get("val")
            swap_call(gm.graph, node, torch.ops.devin.packed_embedding.default, (rows, node.args[1]))
            count += 1
    return count
