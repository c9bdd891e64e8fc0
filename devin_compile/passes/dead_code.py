"""Dead-code elimination that also drops torch.export's metadata asserts.

``aten._assert_tensor_metadata`` / ``_assert_scalar`` nodes have no users but count as
side effects, so plain DCE would keep whatever they check (e.g. the whole causal-mask
subgraph) alive. The runtime validates its own inputs, so they are removed first.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import count_nodes, remove_unused_attributes

aten = torch.ops.aten

_EXPORT_ASSERTS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
                   aten.sym_constrain_range_for_size.default}


def _is_impure(node: torch.fx.Node) -> bool:
    """Random ops (e.g. SDPA's dropout, p=0 in eval) are not side effects here; devin:: ops
    (which write the KV cache) always are."""
    if node.op == "call_function" and getattr(node.target, "namespace", None) == "devin":
        return True
    return node.is_impure(impure_random=False)


def eliminate_dead_code(gm: torch.fx.GraphModule) -> int:
    """Remove export asserts and unreachable nodes and parameters; returns nodes removed.

    The graph is not recompiled here: the pass manager recompiles once after each pass."""
    before = count_nodes(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _EXPORT_ASSERTS:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    remove_unused_attributes(gm)
    return before - count_nodes(gm)
