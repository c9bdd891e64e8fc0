"""fuse_projections: sibling linears that read the same input → one wider linear.

Pattern → replacement::

    y_i = linear(x, W_i[, b_i])  for i = 1..n (n >= 2, same x, all or none with bias)
    →  y = linear(x, cat(W_1..W_n)[, cat(b_1..b_n)]);  y_i = split_with_sizes(y, [N_1..N_n], -1)[i]

This turns q/k/v into one GEMM and gate/up into another, which halves the number of
linear calls per layer and lets the CPU GEMM work on wider tiles. Invariant: each
y_i equals the unfused output (the same dot products, in the same order per column).
Weights that only the fused GEMM read are dropped, so memory does not grow. The fused
linear's ``meta["fused_weights"]`` lists the original weight attributes in row order, and
``meta["fused_slices"]`` the part of each that a tensor-parallel rank kept (their ``tp_slice``, or None).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..graph_utils import add_call, counted_nodes, eliminate_dead_code, fake_like, is_call, node_delta, param_of
from ..pipeline import Pass, PassContext, PassResult

aten = torch.ops.aten


class FuseProjections(Pass):
    name = "fuse_projections"
    requires = ()

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        graph = gm.graph
        before = counted_nodes(gm)
        fused = 0
        position = {n: i for i, n in enumerate(graph.nodes)}
        for x in list(graph.nodes):
            group = [u for u in x.users if is_call(u, aten.linear.default) and u.args[0] is x]
            group = [u for u in group if param_of(gm, u.args[1]) is not None]
            if len(group) < 2:
                continue
            has_bias = [len(u.args) > 2 and u.args[2] is not None for u in group]
            if any(has_bias) and not all(has_bias):
                continue
            weights = [param_of(gm, u.args[1]) for u in group]
            if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
                continue
            order = sorted(group, key=position.__getitem__)
            weights = [param_of(gm, u.args[1]) for u in order]
            name = f"fused_proj_{fused}"
            gm.register_parameter(f"{name}_weight", torch.nn.Parameter(torch.cat(weights, 0), requires_grad=False))
            first = order[0]
            with graph.inserting_before(first):
                w_node = graph.get_attr(f"{name}_weight")
                w_node.meta["val"] = fake_like(first.args[1], getattr(gm, f"{name}_weight"))
                args = [x, w_node]
                if all(has_bias):
                    biases = [param_of(gm, u.args[2]) for u in order]
                    gm.register_parameter(f"{name}_bias", torch.nn.Parameter(torch.cat(biases, 0), requires_grad=False))
                    b_node = graph.get_attr(f"{name}_bias")
                    b_node.meta["val"] = fake_like(first.args[1], getattr(gm, f"{name}_bias"))
                    args.append(b_node)
                y = add_call(graph, aten.linear.default, tuple(args), like=first)
                y.meta["fused_weights"] = [u.args[1].target for u in order]  # for later passes (assign_precision)
                y.meta["fused_slices"] = [u.args[1].meta.get("tp_slice") for u in order]  # a rank's cuts, if any
                sizes = [w.shape[0] for w in weights]
                parts = add_call(graph, aten.split_with_sizes.default, (y, sizes, -1), like=first)
                for i, u in enumerate(order):
                    piece = add_call(graph, operator.getitem, (parts, i), like=u)
                    u.replace_all_uses_with(piece)
            fused += 1
        eliminate_dead_code(gm)
        return PassResult(matches=fused, note=f"{fused} groups fused; {node_delta(gm, before)}")

