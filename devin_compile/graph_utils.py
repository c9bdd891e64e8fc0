"""Small FX helpers shared by passes: new nodes with shape metadata, arg walking."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg

aten = torch.ops.aten
# ops that only reshape (a view where possible): the same elements in the same row-major order
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def fake_value(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def add_call(graph: torch.fx.Graph, target: Callable, args: tuple = (), kwargs: dict | None = None,
             like: torch.fx.Node | None = None) -> torch.fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with ``meta['val']``.

    The fake value is computed by running ``target`` on the inputs' fake values, so dumps
    keep showing shape:dtype for rewritten graphs. ``like`` copies module-stack metadata.
    """
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fargs = map_arg(args, fake_value)
    fkwargs = map_arg(kwargs, fake_value)
    mode = detect_fake_mode([v for v in torch.utils._pytree.tree_leaves((fargs, fkwargs)) if isinstance(v, torch.Tensor)])
    if mode is not None:
        with mode:
            node.meta["val"] = target(*fargs, **fkwargs)
    if like is not None:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def node_shape(node: Any) -> tuple | None:
    v = fake_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def has_shape(node: Any, shape) -> bool:
    """Whether node's value is a tensor of exactly ``shape`` (symbolic sizes: provably equal)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    v = fake_value(node)
    return (isinstance(v, torch.Tensor) and v.dim() == len(shape)
            and all(statically_known_true(a == b) for a, b in zip(v.shape, shape)))


def transpose_dims(node: torch.fx.Node) -> list[int]:
    """The two dims a ``transpose.int`` node swaps, non-negative and sorted."""
    n = fake_value(node).dim()
    return sorted(d % n for d in node.args[1:3])


def describe_value(v: Any) -> str:
    """'f32[1, s0, 576]'-style text for a fake value (or a tuple of them)."""
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).replace("torch.", "")
        return f"{dt}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(describe_value(x) for x in v) + ")"
    if v is None:
        return "-"
    return type(v).__name__


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


_UNCOUNTED = ("placeholder", "output", "get_attr")


def count_nodes(gm: torch.fx.GraphModule) -> int:
    """Nodes that do work (not placeholders, outputs or get_attr): what pass reports count."""
    return sum(1 for n in gm.graph.nodes if n.op not in _UNCOUNTED)


def counted_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes :func:`count_nodes` counts, to compare with the graph after a rewrite."""
    return {n for n in gm.graph.nodes if n.op not in _UNCOUNTED}


def node_delta(gm: torch.fx.GraphModule, before: set[torch.fx.Node]) -> str:
    """``"A nodes added, R removed"``: how ``gm`` changed since ``before`` (its
    :func:`counted_nodes` then), for pass notes; ``A - R`` is the change in node count."""
    after = counted_nodes(gm)
    return f"{len(after - before)} nodes added, {len(before - after)} removed"


def remove_unused_attributes(gm: torch.fx.GraphModule) -> None:
    """Delete parameters/buffers no get_attr node reads any more (after DCE)."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in used:
            owner_path, _, attr = name.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            if attr in owner._parameters:
                del owner._parameters[attr]
            elif attr in owner._buffers:
                del owner._buffers[attr]


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """``copy.deepcopy(graph)`` without torch's spurious LeafSpec FutureWarning.

    ``Graph.__deepcopy__`` deep-copies the pytree specs of the graph's signature, and
    rebuilding a ``LeafSpec`` goes through its deprecated constructor (torch 2.9+), which
    warns on every copy although nothing here uses the deprecated API. Only that warning
    is silenced, and only for this copy.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        return copy.deepcopy(graph)
