"""insert_kv_prune: a ``devin::kv_prune`` node after every attention call (decode and prefill graphs).

Pattern → replacement (in ``decode``, and in ``prefill`` for the SnapKV-style prompt variant)::

    o = paged_attention(q, k, v, layer, scale, softcap, window)
    →
    o = paged_attention(q, k, v, layer, scale, softcap, window)
    kv_prune(q, o, layer, scale, softcap)                 # no outputs; side-effecting

The node folds the layer's attention mass into the pruning scores of the sequences that
prune (see ``ops/kv_prune.py`` and ``runtime/kv_prune/``); with no pruning sequence in a
step it returns at once. In the prefill graph it acts only for requests with
``prefill_window > 0`` whose prompt completes in the step (their last ``prefill_window``
queries score the prompt, which is then pruned once). Invariants: exactly one node per
attention layer in each graph (else ``PassError``); the graphs' outputs are unchanged. Sliding-window, ALiBi
and chunked layers are refused (their window / bias / chunk is counted in slots, which stop being positions
once a sequence is compacted), and so are attention sinks (the attention mass leaves them out).
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
        if "decode" not in program.graphs:
            raise PassError(f"insert_kv_prune needs a 'decode' graph (run split_phases first), got {list(program.graphs)}")
        total, notes = 0, []
        for phase in ("decode", "prefill"):
            if phase in program.graphs:
                n = self._insert(program.graphs[phase], phase, ctx.info.num_layers)
                total += n
                notes.append(f"{phase}: {n}")
        return PassResult(matches=total, note="kv_prune nodes " + ", ".join(notes))

    @staticmethod
    def _insert(gm: torch.fx.GraphModule, phase: str, num_layers: int) -> int:
        graph = gm.graph
        target = torch.ops.devin.kv_prune.default
        if any(is_call(n, target) for n in graph.nodes):
            raise PassError(f"insert_kv_prune: the {phase} graph already has devin::kv_prune nodes")
        if any(is_call(n, torch.ops.devin.mla_attention.default) for n in graph.nodes):
            raise PassError("insert_kv_prune: KV pruning scores per-head keys, but this model's cache holds "
                            "multi-head latent attention latents; drop kv_prune= for this model")
        layers = []
        for node in [n for n in graph.nodes if is_call(n, torch.ops.devin.paged_attention.default)]:
            q, _k, _v, layer, scale = node.args[:5]
            softcap = node.args[5] if len(node.args) > 5 else node.kwargs.get("softcap", 0.0)
            _refuse_unservable(node, layer)
            with graph.inserting_after(node):
                new = graph.call_function(target, (q, node, layer, float(scale), float(softcap)))
            new.meta["val"] = None
            for key in ("nn_module_stack", "stack_trace"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]
            layers.append(layer)
        if sorted(layers) != list(range(num_layers)):
            raise PassError(f"insert_kv_prune inserted nodes for layers {sorted(layers)} of the {phase} graph, "
                            f"expected one per attention layer {list(range(num_layers))}")
        return len(layers)


def _refuse_unservable(node: torch.fx.Node, layer: int) -> None:
    """A ``PassError`` for an attention call KV pruning cannot serve: a sliding window, ALiBi, chunked
    attention (counted in slots, which stop being positions once a sequence is compacted) or sinks."""
    window = node.args[6] if len(node.args) > 6 else node.kwargs.get("sliding_window", -1)
    if window is not None and window > 0:
        raise PassError(f"insert_kv_prune: layer {layer} uses a sliding window of {window} tokens; KV pruning "
                        "supports full-attention layers only (drop kv_prune= for this model)")
    alibi = node.args[7] if len(node.args) > 7 else node.kwargs.get("alibi_slopes")
    if alibi is not None:
        raise PassError(f"insert_kv_prune: layer {layer} uses ALiBi, whose bias is counted in slots, which stop "
                        "being positions once KV pruning compacts a sequence (drop kv_prune= for this model)")
    if node.kwargs.get("attention_chunk", -1) > 0:
        raise PassError(f"insert_kv_prune: layer {layer} uses chunked attention, whose chunks are counted in "
                        "slots, which stop being positions once KV pruning compacts a sequence (drop kv_prune= "
                        "for this model)")
    if node.kwargs.get("sinks") is not None:
        raise PassError(f"insert_kv_prune: layer {layer} has attention sinks, which the attention mass KV "
                        "pruning scores by leaves out (drop kv_prune= for this model)")
