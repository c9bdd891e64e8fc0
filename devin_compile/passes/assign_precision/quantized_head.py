"""The output head quantized in the graph, and the tied embedding that reads it (``assign_precision``).

Pattern → replacement::

    linear(h, W_head[, b])  →  devin::int8_linear(h, qweight, scale, N, kernel, b)      (lm_head="int8")
    embedding(W_head, ids)  →  devin::int8_embedding(ids, qweight, scale, N, K, kernel, dtype)
                               devin::int4_embedding(ids, qweight, scales_zeros, g, N, K, kernel, dtype[, col_scale])
                               (a tied embedding, after an INT4 head: lm_head="int4")

Invariants: the head and its tied embedding read one set of quantized operands (the dense table is no
longer read, so it is released); a lookup returns the head's dequantized rows (AWQ's input scale undone
for INT4), which is what ``quant.simulate`` computes. Under tensor parallelism the head is a vocabulary
shard (its rows, zero rows past V: :mod:`.shards`) and a tied lookup reads that shard with local ids.
"""
from __future__ import annotations

import torch
import torch.fx

from ...graph_utils import add_call, add_constant, fake_like, hf_name, is_call, linear_bias, param_of
from ...ops import int4_embedding  # noqa: F401  (registers devin::int4_embedding)
from ...ops import int8_embedding  # noqa: F401  (registers devin::int8_embedding)
from ...ops import int8_linear as int8_op
from ...pipeline import PassError
from ...quant.precision import Candidate
from ...quant.result import Int8Head
from .shards import shard_int8_head

aten = torch.ops.aten


def int8_head_to_op(gm: torch.fx.GraphModule, head: Int8Head | None, device: torch.device,
                    dtype: torch.dtype) -> tuple[dict | None, int]:
    """The output head's ``linear`` → ``devin::int8_linear`` (``lm_head="int8"``), and the lookups of a
    tied embedding → ``devin::int8_embedding`` of the same operands; (its precision-table row, the lookups
    rewritten), or (None, 0) without an INT8 head."""
    if head is None:
        return None, 0
    nodes = [n for n in gm.graph.nodes if is_call(n, aten.linear.default) and n.args[1].op == "get_attr"
             and hf_name(n.args[1].target) == head.name]
    if len(nodes) != 1:
        raise PassError(f"assign_precision: the INT8 output head {head.name!r} is computed by {len(nodes)} graph "
                        "linears, expected one; was the quantized model made for this model?")
    node, w_node = nodes[0], nodes[0].args[1]
    w = param_of(gm, w_node)
    head = shard_int8_head(head, w_node.meta.get("tp_slice"))  # a vocab-parallel head: this rank's rows
    if tuple(w.shape) != tuple(head.dims):
        raise PassError(f"assign_precision: graph linear {node.name} has weight {tuple(w.shape)}, the INT8 head "
                        f"{head.name!r} has {head.dims}")
    kernel = int8_op.default_kernel(device)
    qw, sc = int8_op.prepare_operands(kernel, head.q, head.scale, device)
    with gm.graph.inserting_before(node):
        qw_node = add_constant(gm, "int8_head_qweight", qw, fake_like(w_node, qw))
        sc_node = add_constant(gm, "int8_head_scale", sc, fake_like(w_node, sc))
        new = add_call(gm.graph, torch.ops.devin.int8_linear.default,
                       (node.args[0], qw_node, sc_node, head.dims[0], kernel), {"bias": linear_bias(node)},
                       like=node)
    tied = _embed_from_int8_head(gm, w, (qw_node, sc_node), head.dims, kernel, dtype)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    fp_bytes = w.numel() * torch.empty((), dtype=dtype).element_size()
    row = {"linear": head.name, "graph_node": new.name, "precision": "int8", "bits": 8, "group_size": None,
           "group_note": "", "sensitivity": head.loss_delta if head.loss_delta is not None else float("nan"),
           "fp8_sensitivity": None, "sensitivity_kind": "loss" if head.loss_delta is not None else "",
           "bytes": int8_op.int8_bytes(*head.dims), "params": w.numel(), "fp_bytes": fp_bytes, "kernel": kernel}
    return row, tied



def _lookups_of(gm: torch.fx.GraphModule, w: torch.Tensor) -> list[torch.fx.Node]:
    """The embedding lookups that read ``w`` (a tied head's dense weight)."""
    # (embedding's other arguments, padding_idx and the gradient flags, do not change its forward)
    return [n for n in gm.graph.nodes if is_call(n, aten.embedding.default) and param_of(gm, n.args[0]) is w]


def _read_again(gm: torch.fx.GraphModule, consts) -> list[torch.fx.Node]:
    """New ``get_attr`` nodes of ``consts`` at the insertion point (the head's constants, read where a lookup is)."""
    here = []
    for const in consts:
        here.append(gm.graph.get_attr(const.target))
        here[-1].meta["val"] = const.meta.get("val")
    return here


def _embed_from_int8_head(gm: torch.fx.GraphModule, w: torch.Tensor, consts: tuple, dims: tuple[int, int],
                          kernel: str, dtype: torch.dtype) -> int:
    """Embedding lookups of ``w`` (the INT8 head's dense weight, tied) → ``devin::int8_embedding`` of the head's
    operands ``consts``, so the dense table is released; returns how many were rewritten."""
    lookups = _lookups_of(gm, w)
    for node in lookups:
        with gm.graph.inserting_before(node):
            new = add_call(gm.graph, torch.ops.devin.int8_embedding.default,
                           (node.args[1], *_read_again(gm, consts), dims[0], dims[1], kernel, dtype), {}, like=node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return len(lookups)


def embed_from_int4_head(gm: torch.fx.GraphModule, i: int, w: torch.Tensor | None, consts: tuple, part,
                     c: Candidate, kernel: str, dtype: torch.dtype) -> int:
    """Embedding lookups of ``w`` (the head's dense weight, tied) → ``devin::int4_embedding`` of the head's INT4
    operands ``consts`` (and AWQ's input scale undone per column), so the dense table is no longer read (and is
    released); returns how many were rewritten."""
    if w is None:
        return 0
    col = part.embedding_col_scale
    if col is not None:
        col_node = add_constant(gm, f"int4_{i}_embedding_col_scale", col.to(w.device), fake_like(consts[0], col))
        consts = (*consts, col_node)
    lookups = _lookups_of(gm, w)
    for node in lookups:
        with gm.graph.inserting_before(node):
            here = _read_again(gm, consts)
            new = add_call(gm.graph, torch.ops.devin.int4_embedding.default,
                           (node.args[1], *here[:2], c.group_size, c.n, c.k, kernel, dtype, *here[2:]), {}, like=node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return len(lookups)
