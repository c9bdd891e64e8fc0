"""cleanup: remove work that does nothing (runs on any graph).

Patterns → replacements:

- export metadata asserts → removed; unreachable nodes → removed (``graph_utils.eliminate_dead_code``)
- ``x.to(dtype)`` / ``_to_copy(x, dtype=…)`` where x already has that dtype → ``x``
- ``dropout(x, p, train=False)`` and ``dropout(x, 0, …)`` → ``x``
- ``transpose(transpose(x, a, b), a, b)`` → ``x``
- ``reshape(x, s)`` / ``view(x, s)`` where x already has shape s → ``x``
- ``reshape(f(x), s)`` where f is a chain of order-keeping views (view, reshape, squeeze,
  unsqueeze) → ``reshape(x, s)``: e.g. attention's output
  ``reshape(transpose(reshape(transpose(unsqueeze(o, 0), 1, 2), same), 1, 2), [1, T, -1])``
  becomes ``reshape(o, [1, T, -1])`` (five dispatched ops → one)
- ``get_attr`` of a nested parameter (``self.m.model.layers[3].mlp...``) → a flat attribute of
  the graph module (one lookup per read instead of one per path component)
- the same pure op on the same inputs computed twice (e.g. HF's per-layer
  ``cos.unsqueeze(1)``) → computed once (torch.fx's CSEPass)

Invariant: values are bit-identical before and after (only no-ops are removed).
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import RESHAPES, count_nodes, eliminate_dead_code, fake_value, has_shape, is_call, transpose_dims
from ..pipeline import Pass, PassContext, PassResult, Program

aten = torch.ops.aten
# views that keep the elements' row-major order (so a reshape after them equals one of their input)
_ORDER_KEEPING = (*RESHAPES, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default)


def _noop_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node ``node`` merely forwards, or None."""
    if is_call(node, aten.to.dtype):
        src = node.args[0]
        v = fake_value(src)
        if isinstance(v, torch.Tensor) and v.dtype == node.args[1] and not node.kwargs.get("copy", False) \
                and node.kwargs.get("memory_format") is None:
            return src
    if is_call(node, aten._to_copy.default):
        src = node.args[0]
        v = fake_value(src)
        if isinstance(v, torch.Tensor) and set(node.kwargs) <= {"dtype"} and node.kwargs.get("dtype", v.dtype) == v.dtype:
            return src
    if is_call(node, aten.dropout.default):
        p = node.args[1]
        train = node.args[2] if len(node.args) > 2 else True
        if p == 0 or not train:
            return node.args[0]
    if is_call(node, *RESHAPES) and has_shape(node.args[0], tuple(fake_value(node).shape)):
        return node.args[0]
    if is_call(node, aten.transpose.int) and is_call(node.args[0], aten.transpose.int):
        inner = node.args[0]
        if fake_value(node) is not None and transpose_dims(node) == transpose_dims(inner):
            return inner.args[0]
    return None


def flatten_attributes(gm: torch.fx.GraphModule) -> int:
    """Re-home every nested parameter/buffer a ``get_attr`` reads as a top-level attribute."""
    moved = 0
    for node in gm.graph.nodes:
        if node.op != "get_attr" or "." not in node.target:
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        flat = "w_" + node.target.replace(".", "_")
        if not hasattr(gm, flat):
            if attr in owner._parameters:
                gm.register_parameter(flat, owner._parameters[attr])
            elif attr in owner._buffers:
                gm.register_buffer(flat, owner._buffers[attr], persistent=False)
            else:
                continue
        node.target = flat
        moved += 1
    return moved


def remove_noops(graph: torch.fx.Graph) -> int:
    """Bypass every no-op node in ``graph`` (left for DCE to remove) and let reshapes skip the
    order-keeping views before them; returns how many nodes changed."""
    count = 0
    for node in list(graph.nodes):
        src = _noop_source(node)
        if src is not None:
            node.replace_all_uses_with(src)
            count += 1
        elif is_call(node, *RESHAPES) and is_call(node.args[0], *_ORDER_KEEPING) and fake_value(node) is not None:
            base = node.args[0]
            while is_call(base, *_ORDER_KEEPING):
                base = base.args[0]
            node.target = aten.reshape.default  # the base may not be viewable as the result
            node.args = (base, *node.args[1:])
            count += 1
    return count


class Cleanup(Pass):
    name = "cleanup"

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        from torch.fx.passes.dialect.common.cse_pass import CSEPass

        folded = removed = 0
        notes = []
        for phase, gm in program.graphs.items():
            before = count_nodes(gm)  # cleanup adds no node, so the drop in count is what it removed
            flatten_attributes(gm)
            folded += remove_noops(gm.graph)
            eliminate_dead_code(gm)
            try:
                result = CSEPass()(gm)
            except TypeError as e:  # CSEPass hashes constant args; Dynamo graphs can hold slice objects
                notes.append(f"CSE skipped on {phase}: {e}")
            else:
                if result.modified:  # adopt the deduplicated graph, keeping gm's pytree codegen
                    new_graph = result.graph_module.graph
                    new_graph._codegen = gm.graph._codegen
                    gm.graph = new_graph
                    eliminate_dead_code(gm)
            removed += before - count_nodes(gm)
        note = f"{folded} no-ops bypassed, {removed} nodes removed (incl. CSE)"
        return PassResult(matches=folded, note="; ".join([note, *notes]))
