"""fuse_moe_experts (CPU, float32): HF's routed-experts subgraph → one ``devin::moe_experts``.

Pattern → replacement (transformers' ``grouped_mm_experts_forward`` as exported on CPU, the
experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, …; ``ids``/``w`` are the router's
top-k indices and weights [T, k], ``x`` the MoE block's rows [T, H])::

    ids_g, perm = sort(reshape(ids, [-1]));  xs = index(x, [perm // k]);  ws = index(reshape(w, [-1]), [perm])
    offs = cumsum(histc(float(ids_g), E, 0, E-1), dtype=int32)
    g, u = chunk(grouped_mm_fallback(xs, transpose(W_gate_up), offs), 2, -1)        # W_gate_up [E, 2F, H]
    y = grouped_mm_fallback(silu(g) * u, transpose(W_down), offs) * unsqueeze(ws, -1) # W_down [E, H, F]
    out = sum(view(index(y, [inverse(perm)]), [T, k, H]), [1])
    →  out = devin.moe_experts(x, ids, w, packed(W_gate_up), packed(W_down))

About 20 dispatched ops and two Python-level expert loops per layer become one call whose CPU
kernel reads each selected expert's weights once per step (at batch 1 only the top-k experts').
The router (softmax / sigmoid, top-k, ``norm_topk_prob``, DeepSeek's group-limited choice) and
Qwen2-MoE's shared expert and its sigmoid gate are left as the model wrote them: the op starts
from the router's ``ids`` and ``w``, so every family's routing stays exact.

Invariants: the same values as the HF subgraph up to float32 summation order (the activation
and the slot sum are the same aten kernels); the packed weights replace the dense ones and are
shared by the prefill and decode graphs. Declines, with the reason per layer in the report
(those experts stay for ``prepack_onednn_experts``): another activation than SiLU, expert biases or a
post-expert norm (the chain differs), hidden/intermediate sizes not multiples of 16, a dtype
other than float32. Skipped off CPU, without a C/C++ compiler, and in the decode graph under
``compile_decode`` (left to Inductor, as ``prepack_onednn_experts`` does).
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_experts import ExpertChain, NoMatch, gate_up_gemms, match_experts
from ..graph_utils import (add_constant, counted_nodes, eliminate_dead_code, grouped_mm_fallback_op, has_call, is_call,
                           node_delta)
from ..ops import moe_experts as moe_op  # registers devin::moe_experts
from ..pipeline import Pass, PassContext, PassResult, Program

aten = torch.ops.aten


def _dead_chain(out: torch.fx.Node, inverse: torch.fx.Node) -> list[torch.fx.Node]:
    """The replaced chain from the slot sum back to the inverse permutation, users first: once the
    sum is replaced nothing reads them, and the in-place ``index_put_`` (which DCE keeps) only
    writes its own ``empty_like`` buffer."""
    view = out.args[0]
    return [out, view, view.args[0], inverse]  # sum(view(index(scaled, [inverse])))


def _layer_name(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """The expert weight's attribute name (it carries the layer), for the report."""
    wt = node.args[1]
    return str(wt.args[0].target) if is_call(wt, aten.transpose.int) and wt.args[0].op == "get_attr" else node.name


class FuseMoEExperts(Pass):
    name = "fuse_moe_experts"
    leaves_compiled_decode = "decode graph left to Inductor (compile_decode)"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        info = ctx.info
        if info is not None and info.device.type != "cpu":
            return f"model is on {info.device.type}, not CPU (the op's reference kernel is no faster there)"
        if info is not None and info.dtype != torch.float32:
            return f"the CPU kernel computes float32; {info.dtype} experts are prepack_onednn_experts'"
        if not has_call(program.graphs.values(), grouped_mm_fallback_op()):
            return "no MoE expert GEMMs (transformers.grouped_mm_fallback) in the graph"
        if not moe_op.load_cpu_kernel():
            return "the C++ kernel of devin::moe_experts cannot be built here (no C/C++ compiler)"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        before = counted_nodes(gm)
        fused, declined = 0, []
        for gate_up in gate_up_gemms(gm.graph):
            m = _match_block(gm, gate_up)
            if isinstance(m, str):
                declined.append(f"{_layer_name(gm, gate_up)}: {m}")
                continue
            self._fuse(gm, ctx, m, fused)
            fused += 1
        eliminate_dead_code(gm)
        note = f"{fused} MoE expert blocks fused; {node_delta(gm, before)}"
        if declined:
            note += "; declined: " + "; ".join(declined)
        return PassResult(matches=fused, note=note)

    def _fuse(self, gm: torch.fx.GraphModule, ctx: PassContext, m: ExpertChain, index: int) -> None:
        """Replace one matched expert block by ``devin::moe_experts`` over its packed weights."""
        graph = gm.graph
        packed = ctx.shared_weights.get(self.name, (m.gate_up, m.down), lambda: moe_op.pack_experts(m.gate_up, m.down))
        with graph.inserting_before(m.out):
            attrs = [add_constant(gm, f"moe_experts_{index}_{suffix}", t)
                     for suffix, t in zip(("gate_up", "down"), packed)]
            new = graph.call_function(torch.ops.devin.moe_experts.default, (m.x, m.ids, m.weights, *attrs))
            new.meta = dict(m.out.meta)
        m.out.replace_all_uses_with(new)
        for dead in _dead_chain(m.out, m.inverse):
            if not dead.users:
                graph.erase_node(dead)


def _match_block(gm: torch.fx.GraphModule, gate_up: torch.fx.Node) -> ExpertChain | str:
    """The expert block starting at ``gate_up``, or why it is declined (the chain differs, or the
    kernel does not serve its sizes or dtype)."""
    try:
        m = match_experts(gm, gate_up)
    except NoMatch as e:
        return str(e)
    _e, f2, h = m.gate_up.shape
    return moe_op.cpu_kernel_declines(m.gate_up.dtype, h, f2 // 2) or m
