"""fuse_silu_mul: the gated MLP's split + silu + mul over a fused gate/up → one ``devin::silu_mul``.

Pattern (after :mod:`.fuse_projections` fused gate_proj and up_proj into one linear)::

    g, u = split_with_sizes(x, [F, F], -1)      # x = gate_up(h), [..., 2F]
    silu(g) * u                                  # either operand order

→ ``devin::silu_mul(x)``. Five graph nodes (three dispatched ops) per layer become one; on CPU
the op's C++ kernel (loaded here) makes the same aten calls. Invariant: bit-identical (the
same silu and mul kernels run). Splits with other users, other activations (GELU) and unfused
gate/up linears do not match.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..graph_utils import add_call, commuted, each_match, fake_value, is_call, replace_matches
from ..ops import silu_mul as silu_mul_op  # registers devin::silu_mul
from ..pipeline import Pass, PassContext, PassResult

aten = torch.ops.aten


def _half(node, index: int):
    """node = split_with_sizes(x, [F, F], -1)[index] → the split node."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == index):
        return None
    split = node.args[0]
    if not is_call(split, aten.split_with_sizes.default):
        return None
    sizes = list(split.args[1])
    dim = split.args[2] if len(split.args) > 2 else 0
    x = fake_value(split.args[0])
    if len(sizes) != 2 or sizes[0] != sizes[1] or x is None or dim not in (-1, x.dim() - 1):
        return None
    return split


def _match(mul: torch.fx.Node):
    """mul(silu(split[0]), split[1]) (either order) → the split's input, when the split has no other users."""
    for act, up in commuted(mul, aten.mul.Tensor):
        if not is_call(act, aten.silu.default) or len(act.users) != 1:
            continue
        split = _half(act.args[0], 0)
        if split is None or _half(up, 1) is not split:
            continue
        if any(u not in (act.args[0], up) for u in split.users) or len(act.args[0].users) != 1:
            continue
        return split.args[0]
    return None


def _build(graph: torch.fx.Graph, node: torch.fx.Node, x: torch.fx.Node) -> torch.fx.Node:
    if fake_value(x).device.type == "cpu":
        silu_mul_op.load_cpu_kernel()
    return add_call(graph, torch.ops.devin.silu_mul.default, (x,), like=node)


class FuseSiluMul(Pass):
    name = "fuse_silu_mul"

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        done = replace_matches(gm, each_match(gm, _match), _build)
        return PassResult(matches=done.count, note=f"{done.count} gated MLPs fused; {done.delta(gm)}")
