"""Positions an attention module computes as ``arange`` over the step's tokens → ``position_ids``.

Capture runs the model without a cache on one sequence, where the i-th token's position is i. Some
attention modules rely on that: Llama 4's NoPE layers scale the query by
``log1p(floor((arange(T) + past + 1) / floor_scale))·attn_scale + 1`` (attention temperature tuning),
with ``past = 0`` without a cache. In the runtime's packed steps the i-th token of a step is not at
position i (a decode step's only token sits at the end of its sequence; several sequences share a
step), so the captured ``arange(T)`` would silently be wrong once positions reach ``floor_scale``.
What it stands for is each token's position, which the graph has as its ``position_ids`` input.

``arange_positions`` replaces, inside the attention modules, every live ``arange(T)`` (``T`` the
step's token count, start 0, step 1) whose users do not index with it by ``position_ids[0]`` (in
the arange's dtype). Run after the rewrite's dead-code elimination: the mask subgraph, which also
reads ``arange(T)``, is gone by then. An ``arange(T)`` used as an index (an identity gather over the
step's tokens) means a token's place in the step, not its position, and is left alone.
"""
from __future__ import annotations

import torch
import torch.fx

from ...capture import module_path_of
from ...graph_utils import add_call, fake_value, is_call

aten = torch.ops.aten

_INDEXING = (aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.index_put.default,
             aten.index_put_.default, aten.scatter.src, aten.scatter_add.default)


def _step_length(gm: torch.fx.GraphModule) -> object:
    """The symbolic token count T (``input_ids``' second dimension)."""
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return fake_value(ids).shape[1]


def _is_step_arange(node: torch.fx.Node, T: object) -> bool:
    """``arange(T)``, ``arange(0, T)`` or ``arange(0, T, 1)``: one integer per token of the step, 0 .. T-1."""
    if not (is_call(node, aten.arange.default) or (is_call(node, aten.arange.start) and node.args[0] == 0)
            or (is_call(node, aten.arange.start_step) and node.args[0] == 0 and node.args[2] == 1)):
        return False
    val = fake_value(node)
    if val is None or val.dim() != 1 or val.is_floating_point():
        return False
    size = val.shape[0]
    return isinstance(size, torch.SymInt) and isinstance(T, torch.SymInt) and size.node.expr == T.node.expr


def arange_positions(gm: torch.fx.GraphModule, attention_modules: list[str]) -> list[str]:
    """Rewrite the attention modules' step ``arange``s used as positions (see the module docstring);
    returns the module paths rewritten."""
    graph = gm.graph
    T = _step_length(gm)
    pos = [n for n in graph.nodes if n.op == "placeholder"][1]
    done = []
    for node in list(graph.nodes):
        if not _is_step_arange(node, T) or not node.users:
            continue
        path = module_path_of(node, among=attention_modules)
        if path is None or any(is_call(u, *_INDEXING) for u in node.users):
            continue
        with graph.inserting_before(node):
            flat = add_call(graph, aten.select.int, (pos, 0, 0), like=node)
            if fake_value(flat).dtype != fake_value(node).dtype:
                flat = add_call(graph, aten._to_copy.default, (flat,), {"dtype": fake_value(node).dtype}, like=node)
        node.replace_all_uses_with(flat)
        graph.erase_node(node)
        done.append(path)
    return done
