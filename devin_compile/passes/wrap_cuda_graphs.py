"""wrap_cuda_graphs (CUDA): mark the decode graph's buckets for capture as CUDA Graphs.

Pattern → replacement::

    Program.graphs["decode"] (every node capture-safe)
        →  Program.cuda_graph_buckets = (1, 2, 4, …, the first bucket ≥ a step's most rows)

The pass checks the decode graph and names the buckets; it holds no runtime state. The capture
itself needs the engine's real KV pool (a CUDA Graph records the pool's addresses), so the
runtime does it when it builds the runner (``runtime/decode_graphs.py``): per bucket, static
input buffers and one graph, largest bucket first, in one memory pool; a step copies its rows
into the bucket's buffers and replays. Batches above the largest bucket, KV-pruning steps and
backends that read host-side step values run uncaptured.

Capture-safe means: no host sync, no value-dependent shape, allocation or grid. A node is not
when it is one of the ops that read values on the host (``nonzero``, ``masked_select``,
``item``, ``unique``, …), a ``devin::`` op whose kernel loops over the step's sequences on the
host (``mla_attention``), a value whose shape depends on data (an unbacked size), or a value on
another device (an ``offload_layers=`` embedding or head on the CPU inside a CUDA step). Such a
graph is not captured, and the report names the first nodes and why (decode then runs as the
uncaptured decode graph, as before).

Buckets: those a decode step can reach (``max_num_seqs`` rows, or ``max_verify_tokens`` with
speculative decoding, whose verify rows are decode rows), plus the first bucket above.

Invariant: the graphs are unchanged; for every marked bucket the replayed step's logits are the
uncaptured decode graph's (greedy tokens identical).
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..pipeline import Pass, PassContext, PassResult, Program
from ..step import reachable_buckets

# aten ops (by overload packet) that read tensor values on the host or size outputs by them
HOST_SYNC_ATEN = frozenset({
    "nonzero", "masked_select", "_local_scalar_dense", "item", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "equal", "is_nonzero", "_assert_async", "bincount",
})
# devin:: ops whose kernels read the step's metadata on the host (they loop over sequences)
HOST_LOOP_DEVIN = {"mla_attention": "loops over the step's sequences on the host (multi-head latent attention)"}


def _op_name(target) -> tuple[str, str] | None:
    """(namespace, op name) of an OpOverload / OpOverloadPacket target, else None."""
    packet = getattr(target, "overloadpacket", target)
    ns, name = getattr(packet, "_qualified_op_name", "::").split("::", 1)
    return (ns, name) if ns else None


def _devices(val) -> set[torch.device]:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return {v.device for v in vals if isinstance(v, torch.Tensor)}


def _node_blocker(node: torch.fx.Node, device: torch.device) -> str | None:
    """Why ``node`` cannot be inside a CUDA Graph of a step on ``device``, or None."""
    if node.op == "call_function":
        op = _op_name(node.target)
        if op is not None and op[0] == "aten" and op[1] in HOST_SYNC_ATEN:
            return f"aten.{op[1]} reads tensor values on the host"
        if op is not None and op[0] == "devin" and op[1] in HOST_LOOP_DEVIN:
            return f"devin::{op[1]} {HOST_LOOP_DEVIN[op[1]]}"
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor) and free_unbacked_symbols(v.shape):
            return "its shape depends on tensor values"
    other = {d for d in _devices(val) if d.type != device.type}
    if other and node.op != "output":
        return f"a value on {sorted(str(d) for d in other)[0]} inside a {device.type} step (offload_layers=?)"
    return None


def capture_blockers(gm: torch.fx.GraphModule, device: torch.device, limit: int = 3) -> list[str]:
    """Up to ``limit`` nodes of ``gm`` that keep a step on ``device`` from being captured, as
    ``"name (target): reason"``, one per distinct reason; [] when the graph is capture-safe."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        why = _node_blocker(node, torch.device(device))
        if why is not None and why not in found:
            found[why] = f"{node.name} ({node.target}): {why}"
            if len(found) == limit:
                break
    return list(found.values())


class WrapCudaGraphs(Pass):
    name = "wrap_cuda_graphs"
    requires = ("split_phases",)

    def __init__(self, max_rows: int) -> None:
        super().__init__()
        self.max_rows = max_rows  # the most rows a decode step can have (sequences, or verify rows)

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if ctx.info is None or ctx.info.device.type != "cuda":
            where = "no model device" if ctx.info is None else ctx.info.device.type
            return f"CUDA only (here: {where}; on CPU compile_decode makes static decode callables)"
        if "decode" not in program.graphs:
            return "no decode graph (split_phases is off)"
        return None

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        blockers = capture_blockers(program.graphs["decode"], ctx.info.device)
        if blockers:
            program.cuda_graph_buckets = ()
            return PassResult(matches=0, note="decode not captured: " + "; ".join(blockers))
        program.cuda_graph_buckets = reachable_buckets(program.decode_buckets, self.max_rows)
        return PassResult(matches=len(program.cuda_graph_buckets),
                          note=f"CUDA Graphs for decode buckets {list(program.cuda_graph_buckets)} "
                               "(captured over the KV pool when the engine is built)")
