"""The FX helpers passes share (the one module for them: a pass imports no other pass).

- reading a graph: :func:`fake_value`, :func:`node_shape`, :func:`has_shape`, :func:`is_call`, :func:`has_call`,
  :func:`commuted`,
  :func:`param_of`, :func:`linear_bias`, :func:`is_logits_linear`, :func:`cpu_linears`,
  :func:`grouped_mm_fallback_op`, :func:`is_expert_transpose`, :func:`transposed_expert_weight`;
- writing it: :func:`add_call` (a node with its fake value), :func:`add_constant` (a tensor the
  graph reads), :func:`fake_like`, :func:`swap_call` (a node for another, same metadata),
  :func:`replace_matches` (the match → insert → replace → dead-code loop of a rewrite pass),
  :func:`eliminate_dead_code`, :func:`remove_unused_attributes`, :func:`copy_graph`;
- reporting: :func:`count_nodes`, :func:`counted_nodes`, :func:`node_delta`, :func:`describe_value`.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

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


def commuted(node: Any, *targets: Any) -> tuple[tuple, ...]:
    """Both operand orders, ``(a, b)`` and ``(b, a)``, of a two-argument call of one of ``targets``
    (``()`` for any other node): for matching commutative ops such as ``add`` and ``mul``."""
    if not is_call(node, *targets) or len(node.args) != 2:
        return ()
    return tuple(node.args), tuple(node.args[::-1])


def has_call(gms: Iterable[torch.fx.GraphModule], target: Any) -> bool:
    """Whether any of the graphs calls ``target`` (False for a None target)."""
    return target is not None and any(is_call(n, target) for gm in gms for n in gm.graph.nodes)


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


# --------------------------------------------------------------------------- weights and linears


def param_of(gm: torch.fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads (None for any other node or value)."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        owner = gm.get_submodule(node.target.rpartition(".")[0]) if "." in node.target else gm
        return getattr(owner, node.target.rpartition(".")[2])
    return None


def hf_name(target: str) -> str:
    """Graph attribute of a captured weight → HF module name (``m.model.layers.0.mlp.up_proj.weight``
    → ``model.layers.0.mlp.up_proj``)."""
    name = target[2:] if target.startswith("m.") else target
    return name[: -len(".weight")] if name.endswith(".weight") else name


def fake_like(reference_node: torch.fx.Node, tensor: torch.Tensor) -> Any:
    """A fake tensor for ``tensor`` in the fake mode of ``reference_node``'s value (None without one),
    made the way export made the reference: a static shape (a mode with a shape environment would
    otherwise give it fresh symbolic sizes) and, for a float tensor, the reference's
    ``requires_grad`` (torch < 2.12 computes ``aten.linear`` on symbolic activations only through
    the autograd path that a lifted parameter takes; a plain fake weight there fails)."""
    ref = reference_node.meta.get("val")
    mode = getattr(ref, "fake_mode", None)
    if mode is None:
        return None
    fake = mode.from_tensor(tensor, static_shapes=True)
    if ref.requires_grad and fake.is_floating_point():
        fake.requires_grad_(True)
    return fake


def add_constant(gm: torch.fx.GraphModule, name: str, tensor: torch.Tensor, val: Any = None, *,
                 persistent: bool = False) -> torch.fx.Node:
    """Register ``tensor`` as buffer ``name`` of ``gm`` (once) and read it with a ``get_attr`` node at
    the graph's insertion point; ``val`` becomes the node's ``meta['val']`` (shown in dumps)."""
    if name not in gm._buffers:
        gm.register_buffer(name, tensor, persistent=persistent)
    node = gm.graph.get_attr(name)
    node.meta["val"] = val
    return node


def linear_bias(node: torch.fx.Node) -> Any:
    """The bias argument of an ``aten.linear`` node (None when it has none)."""
    return node.args[2] if len(node.args) > 2 else None


def reaches_output(node: torch.fx.Node, barrier: Callable[[torch.fx.Node], bool]) -> bool:
    """Whether a walk over ``node``'s users meets the graph output before any node ``barrier`` accepts."""
    frontier, seen = list(node.users), set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            return True
        if barrier(n):
            return False
        frontier.extend(n.users)
    return False


def is_logits_linear(node: torch.fx.Node) -> bool:
    """The linear whose output reaches the graph output without another linear in between (lm_head)."""
    if not is_call(node, aten.linear.default) or node.args[1].op != "get_attr":
        return False
    return reaches_output(node, lambda n: is_call(n, aten.linear.default))


def cpu_linears(gm: torch.fx.GraphModule, dtypes: tuple[torch.dtype, ...] | None = None):
    """(node, weight, bias node) for each ``aten.linear`` whose weight is a 2-D floating CPU
    parameter (of one of ``dtypes``, when given); a list, so callers may rewrite as they go."""
    out = []
    for node in gm.graph.nodes:
        if not is_call(node, aten.linear.default):
            continue
        w = param_of(gm, node.args[1])
        if w is None or w.dim() != 2 or not w.dtype.is_floating_point or w.device.type != "cpu":
            continue
        if dtypes is not None and w.dtype not in dtypes:
            continue
        out.append((node, w, linear_bias(node)))
    return out


def grouped_mm_fallback_op() -> Any:
    """``torch.ops.transformers.grouped_mm_fallback``: HF's MoE expert GEMMs as exported on CPU
    (None where transformers registers no such op)."""
    ns = getattr(torch.ops, "transformers", None)
    try:
        return ns.grouped_mm_fallback.default if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


def is_expert_transpose(node: Any) -> bool:
    """``node`` is ``transpose(W, -2, -1)`` of a 3-D value (HF's expert weights [E, out, in], transposed)."""
    return is_call(node, aten.transpose.int) and sorted(a % 3 for a in node.args[1:3]) == [1, 2]


def transposed_expert_weight(gm: torch.fx.GraphModule, node: Any) -> torch.Tensor | None:
    """W when ``node`` is ``transpose(W, -2, -1)`` of a 3-D parameter W [E, out, in] (HF's expert layout)."""
    if not is_expert_transpose(node):
        return None
    w = param_of(gm, node.args[0])
    return w if w is not None and w.dim() == 3 else None


# --------------------------------------------------------------------------- rewriting

_EXPORT_ASSERTS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
                   aten.sym_constrain_range_for_size.default}


def _is_impure(node: torch.fx.Node) -> bool:
    """Random ops (e.g. SDPA's dropout, p=0 in eval) are not side effects here; devin:: ops
    (which write the KV cache) always are."""
    if node.op == "call_function" and getattr(node.target, "namespace", None) == "devin":
        return True
    return node.is_impure(impure_random=False)


def eliminate_dead_code(gm: torch.fx.GraphModule) -> int:
    """Remove torch.export's metadata asserts, then unreachable nodes and parameters; returns the
    nodes removed. The asserts (``_assert_tensor_metadata``, ...) have no users but count as side
    effects, so plain DCE would keep whatever they check (e.g. the whole causal-mask subgraph)
    alive; the runtime validates its own inputs. The graph is not recompiled here: the pass
    manager recompiles once after each pass."""
    before = count_nodes(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _EXPORT_ASSERTS:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    remove_unused_attributes(gm)
    return before - count_nodes(gm)


def swap_call(graph: torch.fx.Graph, node: torch.fx.Node, target: Callable, args: tuple,
              kwargs: dict | None = None) -> torch.fx.Node:
    """Replace ``node`` by ``target(*args, **kwargs)`` inserted before it, with ``node``'s metadata
    (same shape, dtype and module stack); ``node`` is erased."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


M = TypeVar("M")


def each_match(gm: torch.fx.GraphModule,
               match: Callable[[torch.fx.Node], M | None]) -> Iterator[tuple[torch.fx.Node, M]]:
    """``(node, match(node))`` for the graph's nodes (as they were when it started) that match."""
    for node in list(gm.graph.nodes):
        m = match(node)
        if m is not None:
            yield node, m


@dataclass
class Rewritten:
    """What :func:`replace_matches` did: ``count`` replacements, from the counted nodes ``before``."""

    count: int
    before: set[torch.fx.Node]

    def delta(self, gm: torch.fx.GraphModule) -> str:
        """``"A nodes added, R removed"`` since the rewrite started (see :func:`node_delta`)."""
        return node_delta(gm, self.before)


def replace_matches(gm: torch.fx.GraphModule, matches: Iterable[tuple[torch.fx.Node, M]],
                    build: Callable[[torch.fx.Graph, torch.fx.Node, M], torch.fx.Node]) -> Rewritten:
    """A rewrite pass's loop. For each ``(old, match)``, ``build(graph, old, match)`` inserts the
    replacement before ``old`` and returns its output node, to which ``old``'s uses move; the
    matched chain, dead then, is removed at the end. ``matches`` is read lazily (each match sees
    the graph as rewritten so far), e.g. :func:`each_match`."""
    graph = gm.graph
    before = counted_nodes(gm)
    count = 0
    for old, match in matches:
        with graph.inserting_before(old):
            new = build(graph, old, match)
        old.replace_all_uses_with(new)
        count += 1
    eliminate_dead_code(gm)
    return Rewritten(count, before)
