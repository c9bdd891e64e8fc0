"""split_phases: one captured graph → a ``prefill`` graph and a ``decode`` graph.

Pattern → replacement::

    Program{main}  →  Program{prefill: main, decode: copy of main, specialised}

- ``prefill`` is the captured graph unchanged: several prompts (or prompt chunks) packed
  end to end with no padding; the runtime asks for logits only at the last token of
  each sequence that samples (``logits_indices``).
- ``decode`` runs exactly one new token per sequence, and every one of them samples, so
  ``logits_indices`` is always ``arange(T)``: the gather of the last hidden states
  before lm_head (``aten.index.Tensor(h, [None, logits_indices])``) is dropped and lm_head
  reads ``h`` directly. Its batch sizes come from ``decode_buckets`` (1, 2, 4, ..., 128 by
  default: ``config.DEFAULT_DECODE_BUCKETS``; ``step.decode_bucket`` picks a batch's bucket). When the runtime pads a decode batch up to its bucket (for static-shape
  decode callables: CUDA Graphs, ahead-compiled CPU decode), the dummy tokens get slot
  -1, so their K/V writes are skipped and they touch no real KV page; their rows are
  discarded.

Invariants: both graphs keep the signature ``(input_ids, position_ids, logits_indices)``
and give the same logits as the unsplit graph on their inputs; the two graphs share
parameter and buffer tensors (the copy holds references, not copies, of weights);
later passes can specialise one phase by looking at the ``phase`` name.
"""
from __future__ import annotations

import torch
import torch.fx

from ..config import DEFAULT_DECODE_BUCKETS
from ..graph_utils import copy_graph, is_call
from ..pipeline import Pass, PassContext, PassError, PassResult, Program

aten = torch.ops.aten

class SplitPhases(Pass):
    name = "split_phases"
    requires = ("attention_to_paged",)

    def __init__(self, decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS) -> None:
        super().__init__()
        if not decode_buckets or any(not isinstance(b, int) or b < 1 for b in decode_buckets):
            raise ValueError(f"decode_buckets={decode_buckets!r} must be a non-empty list of positive integers")
        self.decode_buckets = tuple(sorted(set(decode_buckets)))

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if "decode" in program.graphs:
            return "program is already split"
        return None

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        main = program.graphs.get("main")
        if main is None:
            raise PassError(f"split_phases needs a 'main' graph, got {list(program.graphs)}")
        graph = copy_graph(main.graph)
        # GraphModule(root, graph) binds each get_attr target to the root's tensor object:
        # the decode graph shares every weight with prefill.
        decode = torch.fx.GraphModule(main, graph, class_name="DecodeGraph")
        gathers = _drop_logits_gather(decode.graph)
        if gathers != 1:
            raise PassError(
                f"split_phases expected exactly one logits gather (aten.index.Tensor on logits_indices) before "
                f"lm_head, found {gathers}; the captured graph does not have the FlatTokensLM signature"
            )
        decode.graph.eliminate_dead_code()
        program.graphs = {"prefill": main, "decode": decode}
        program.decode_buckets = self.decode_buckets
        return PassResult(matches=gathers, note=f"decode buckets {list(self.decode_buckets)}; logits gather dropped")


def _drop_logits_gather(graph: torch.fx.Graph) -> int:
    """Replace ``index(h, [None, logits_indices])`` by ``h``; returns how many were replaced."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 3:
        return 0
    idx = placeholders[2]
    count = 0
    for node in list(idx.users):
        if is_call(node, aten.index.Tensor) and list(node.args[1]) == [None, idx]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            count += 1
    return count
