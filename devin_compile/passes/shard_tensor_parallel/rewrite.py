"""shard_tensor_parallel's graph edits: keep a rank's rows or columns of a weight, sum row-parallel
outputs over the ranks, and re-derive the shapes (``meta['val']``) downstream of what changed."""
from __future__ import annotations

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg

from ...config.weight_slice import WeightSlice
from ...graph_utils import add_call, fake_like, fake_value, linear_bias
from ...pipeline import PassError
from .plan import module_of

_c10d = torch.ops._c10d_functional


def set_tensor(gm: torch.fx.GraphModule, node: torch.fx.Node, tensor: torch.Tensor, *,
               tied: bool = False) -> torch.Tensor:
    """Make the ``get_attr`` ``node`` read ``tensor`` (a parameter stays a parameter, a buffer a buffer);
    returns the object the graph now holds (pass it for another ``get_attr`` of a tied weight, so
    both read one tensor). Only ``tied`` (the caller rewrites every reader: ``vocab.py``) allows a
    weight that several nodes read."""
    if len(node.users) != 1 and not tied:
        raise PassError(f"{module_of(next(iter(node.users)))}: weight {node.target} is read by {len(node.users)} "
                        "nodes (tied?); shard_tensor_parallel splits weights that one linear reads")
    prefix, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(prefix) if prefix else gm
    if attr in owner._parameters:
        if not isinstance(tensor, torch.nn.Parameter):
            tensor = torch.nn.Parameter(tensor, requires_grad=False)
        owner._parameters[attr] = tensor
    else:
        owner._buffers[attr] = tensor
    node.meta["val"] = fake_like(node, tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
    return tensor


def tensor_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor:
    prefix, _, attr = node.target.rpartition(".")
    return getattr(gm.get_submodule(prefix) if prefix else gm, attr)


def keep(gm: torch.fx.GraphModule, node: object, index: range | list[range], dim: int) -> torch.fx.Node | None:
    """``node`` (a ``get_attr``; None passes through) now reads only ``index`` along ``dim`` (a range, or
    ranges put one after another): a copy, so the full tensor is not held by the graph. The cut is
    recorded in ``node.meta["tp_slice"]`` (a :class:`WeightSlice`, for ``assign_precision``)."""
    if node is None:
        return None
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        raise PassError(f"{module_of(node)}: {node} is not a weight of the graph; cannot split it")
    full = tensor_of(gm, node)
    parts = index if isinstance(index, list) else [index]
    if any(full.shape[dim] < r.stop for r in parts):
        raise PassError(f"{node.target}: {full.shape[dim]} entries along dim {dim}, cannot keep {index}")
    cut = WeightSlice(dim, tuple(parts), full.shape[dim])
    set_tensor(gm, node, cut.take(full))
    node.meta["tp_slice"] = cut
    return node


def column_parallel(gm: torch.fx.GraphModule, linear: torch.fx.Node, rows: range) -> None:
    """The linear computes only output features ``rows`` (weight rows and bias entries)."""
    keep(gm, linear.args[1], rows, 0)
    keep(gm, linear_bias(linear), rows, 0)


def row_parallel(gm: torch.fx.GraphModule, linear: torch.fx.Node, cols: range, group_name: str) -> torch.fx.Node:
    """The linear reads only input features ``cols``; its partial sums are added over the ranks with one
    ``all_reduce`` (a functional collective, so the graph stays traceable), and its bias, if any,
    is added once after the sum. Returns the node that now stands for the linear's output."""
    keep(gm, linear.args[1], cols, 1)
    bias = linear_bias(linear)
    if bias is not None:
        linear.args = linear.args[:2]
    out = sum_over_ranks(gm, linear, group_name)
    if bias is not None:
        with gm.graph.inserting_after(out):
            summed = add_call(gm.graph, torch.ops.aten.add.Tensor, (out, bias), like=linear)
        out.replace_all_uses_with(summed, delete_user_cb=lambda u: u is not summed)
        out = summed
    return out


def sum_over_ranks(gm: torch.fx.GraphModule, node: torch.fx.Node, group_name: str) -> torch.fx.Node:
    """Every user of ``node`` (a partial sum) now reads its sum over the ranks: ``wait(all_reduce(node))``."""
    graph = gm.graph
    users = list(node.users)
    with graph.inserting_after(node):
        summed = add_call(graph, _c10d.all_reduce.default, (node, "sum", group_name), like=node)
    with graph.inserting_after(summed):
        out = add_call(graph, _c10d.wait_tensor.default, (summed,), like=node)
    for u in users:
        u.replace_input_with(node, out)
    return out


def refresh_shapes(gm: torch.fx.GraphModule, changed: set[torch.fx.Node]) -> int:
    """Recompute ``meta['val']`` of every node downstream of ``changed`` (in graph order, on fake
    tensors); a node whose computation no longer fits (a view that hard-codes a head count) is a
    :class:`PassError` naming its module. Returns how many nodes were recomputed."""
    dirty = set(changed)
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not any(i in dirty for i in node.all_input_nodes):
            continue
        old = node.meta.get("val")
        node.meta["val"] = _fake_call(node)
        count += 1
        if _signature(node.meta["val"]) != _signature(old):
            dirty.add(node)
    return count


def _fake_call(node: torch.fx.Node):
    args, kwargs = map_arg(node.args, fake_value), map_arg(node.kwargs, fake_value)
    leaves = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(leaves)
    try:
        if mode is None:
            return node.target(*args, **kwargs)
        with mode:
            return node.target(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise PassError(f"{module_of(node)}: after splitting over ranks, {node.name} ({node.target}) no longer fits "
                        f"its inputs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the layer "
                        "hard-codes a head count or width") from e


def _signature(val) -> object:
    return tuple(f"{tuple(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else str(v)
                 for v in torch.utils._pytree.tree_leaves(val))
