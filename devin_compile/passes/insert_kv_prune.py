"""insert_kv_prune: a ``devin::kv_prune`` node after every attention call of the decode graph.

Pattern → replacement (``decode`` graph only; ``prefill`` is left as it is)::

    o = paged_attention(q, k, v, layer, scale, softcap, window)
    →
    o = paged_attention(q, k, v, layer, scale, softcap, window)
    kv_prune(q, o, layer, scale, softcap)                 # no outputs; side-effecting

The node folds the layer's attention mass into the pruning scores of the sequences that
prune (see ``ops/kv_prune.py`` and ``runtime/kv_prune.py``); with no pruning sequence in a
step it returns at once. Invariants: exactly one node per attention layer (else
``PassError``); the graph's outputs are unchanged. Sliding-window layers are refused: their
window is counted in slots, which stop being positions once a sequence is compacted.
Enabled by ``optimize(kv_prune=...)`` (or inside ``enable_kv_pruning``).
"""
from __future__ import annotations

import torch
import torch.fx

from .. import ops as _ops  # noqa: F401  (registers devin::kv_prune)
from ..graph_utils import is_call
from ..pipeline import Pass, PassContext, PassError, PassResult, Program


class InsertKVPrune(Pass):
    name = "insert_kv_prune"
    requires = ("attention_to_paged", "split_phases")

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        gm = program.graphs.get("decode")
        if gm is None:
            raise PassError(f"insert_kv_prune needs a 'decode' graph (run split_phases first), got {list(program.graphs)}")
        graph = gm.graph
        target = torch.ops.devin.kv_prune.default
        if any(is_call(n, target) for n in graph.nodes):
            raise PassError("insert_kv_prune: the decode graph already has devin::kv_prune nodes")
        sites = [n for n in graph.nodes if is_call(n, torch.ops.devin.paged_attention.default)]
        layers = []
        for node in sites:
            q, _k, _v, layer, scale = node.args[:5]
            softcap = node.args[5] if len(node.args) > 5 else node.kwargs.get("softcap", 0.0)
            window = node.args[6] if len(node.args) > 6 else node.kwargs.get("sliding_window", -1)
            if window is not None and window > 0:
                raise PassError(f"insert_kv_prune: layer {layer} uses a sliding window of {window} tokens; KV pruning "
                                "supports full-attention layers only (drop kv_prune= for this model)")
            with graph.inserting_after(node):
                new = graph.call_function(target, (q, node, layer, float(scale), float(softcap)))
            new.meta["val"] = None
            for key in ("nn_module_stack", "stack_trace"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]
            layers.append(layer)
        expected = list(range(ctx.info.num_layers))
        if sorted(layers) != expected:
            raise PassError(f"insert_kv_prune inserted nodes for layers {sorted(layers)}, expected one per attention "
                            f"layer {expected}")
        return PassResult(matches=len(layers), note=f"{len(layers)} kv_prune nodes (decode graph)")
