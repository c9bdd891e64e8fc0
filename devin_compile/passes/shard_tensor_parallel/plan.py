"""Which linears shard_tensor_parallel splits, read from the graph's dataflow (not from module names).

- attention (per ``devin::paged_attention`` node): the one linear each of q, k and v comes from
  (walking back through views, rotary, per-head norms) is column-parallel; the linear that reads
  the op's output through views only is row-parallel;
- MLP: a linear whose input comes, through elementwise ops only (activations, products, casts,
  scalar arithmetic), from linears that all read one tensor: those are column-parallel, it is
  row-parallel (gate/up → down, fc1 → fc2); nothing else may read the column outputs;
- routed experts (HF's grouped expert GEMMs, the chain ``fuse_moe_experts`` matches): each expert's
  gate/up rows and down columns split alike over its intermediate features; the router linear (the
  one the expert ids come from) stays whole, so routing is exact on every rank;
- the logits linear(s): vocab-parallel (``vocab.py`` plans which embedding lookups share or follow
  that split); norms stay whole on every rank.

Any other linear is a :class:`PassError` naming its module: it is never silently replicated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ...graph_experts import expert_blocks
from ...graph_utils import is_call, is_logits_linear, param_of
from ...pipeline import PassError

aten = torch.ops.aten

#: Ops that only move a tensor's elements around (attention output → output projection).
VIEWS = (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.transpose.int, aten.permute.default,
         aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.clone.default,
         aten.contiguous.default, aten.to.dtype, aten._to_copy.default)

#: Ops that act column by column (on a column-split tensor they give the column split of the result).
ELEMENTWISE = (aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
               aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.div.Tensor,
               aten.pow.Tensor_Scalar, aten.neg.default, aten.to.dtype, aten._to_copy.default, aten.clamp.default,
               aten.clone.default)


@dataclass
class AttentionShard:
    """One attention layer: column-parallel q, k, v linears, row-parallel o linear."""

    path: str
    attention: torch.fx.Node
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    o: torch.fx.Node


@dataclass
class MLPShard:
    """One MLP: column-parallel linears (gate, up) and the row-parallel linear after them (down)."""

    path: str
    columns: list[torch.fx.Node]
    row: torch.fx.Node


@dataclass
class ExpertsShard:
    """One routed-experts block: its expert weights (``get_attr`` of W_gate_up [E, 2F, H] and W_down
    [E, H, F]), the router linear (replicated) and the slot sum (the block's output, a partial sum)."""

    path: str
    router: torch.fx.Node
    gate_up: torch.fx.Node
    down: torch.fx.Node
    out: torch.fx.Node


@dataclass
class ShardPlan:
    attention: list[AttentionShard]
    mlps: list[MLPShard]
    heads: list[torch.fx.Node]  # the logits linear(s): vocab-parallel (vocab.py)
    experts: list[ExpertsShard] = field(default_factory=list)

    def linears(self) -> list[torch.fx.Node]:
        out = [n for a in self.attention for n in (a.q, a.k, a.v, a.o)]
        return out + [n for m in self.mlps for n in (*m.columns, m.row)]


def module_of(node: torch.fx.Node) -> str:
    """The innermost module a node was traced in (for errors), e.g. ``model.layers.0.mlp.up_proj``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return node.name
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L__self__.", "").removeprefix("m.")


def plan_shards(gm: torch.fx.GraphModule) -> ShardPlan:
    """The split of every linear of ``gm`` (see the module docstring); :class:`PassError` otherwise."""
    attention = [_attention(n) for n in gm.graph.nodes if is_call(n, torch.ops.devin.paged_attention.default)]
    if not attention:
        raise PassError("shard_tensor_parallel found no devin::paged_attention node; it runs after attention_to_paged")
    taken = {n for a in attention for n in (a.q, a.k, a.v, a.o)}
    experts = _experts(gm)
    taken.update(e.router for e in experts)
    linears = [n for n in gm.graph.nodes if is_call(n, aten.linear.default)]
    mlps: list[MLPShard] = []
    for node in linears:
        if node in taken or is_logits_linear(node):
            continue
        mlp = _mlp(node, taken)
        if mlp is not None:
            mlps.append(mlp)
            taken.update((*mlp.columns, mlp.row))
    heads = [n for n in linears if n not in taken and is_logits_linear(n)]
    left = [n for n in linears if n not in taken and n not in heads]
    if left:
        raise PassError(
            f"shard_tensor_parallel cannot split {module_of(left[0])} (linear {left[0].name}"
            f"{f' and {len(left) - 1} more' if len(left) > 1 else ''}) over ranks: it is neither a q/k/v/output "
            "projection of an attention layer nor part of an MLP (linears reading one input → elementwise ops "
            "→ one linear); it is not replicated silently")
    for n in (*taken, *heads):
        if param_of(gm, n.args[1]) is None:
            raise PassError(f"{module_of(n)}: linear {n.name} has no weight parameter; cannot split it")
    return ShardPlan(attention, mlps, heads, experts)


def _experts(gm: torch.fx.GraphModule) -> list[ExpertsShard]:
    """Every routed-experts block, or a :class:`PassError` naming one whose chain is not HF's."""
    out = []
    for gate_up, m in expert_blocks(gm):
        path = module_of(gate_up).rpartition(".")[0] or module_of(gate_up)
        if isinstance(m, str):
            raise PassError(f"{path}: cannot split its experts over ranks: {m}")
        router = _one_source_linear(m.ids, path, "expert ids")
        weights = (gate_up.args[1].args[0], m.down_gemm.args[1].args[0])
        if any(w.op != "get_attr" or len(w.users) != 1 for w in weights):
            raise PassError(f"{path}: its expert weights are not parameters read once; cannot split them")
        out.append(ExpertsShard(path, router, *weights, m.out))
    return out


def _attention(node: torch.fx.Node) -> AttentionShard:
    path = module_of(node)
    q, k, v = (_one_source_linear(node.args[i], path, name) for i, name in enumerate(("query", "key", "value")))
    if len({q, k, v}) != 3:
        raise PassError(f"{path}: query, key and value come from one fused linear; shard_tensor_parallel "
                        "splits separate q/k/v projections only")
    o = _output_linear(node)
    if o is None:
        raise PassError(f"{path}: the attention output does not reach one linear through views only "
                        "(an output gate or other op in between); cannot split its output projection")
    for lin in (q, k, v):
        _check_confined(lin, {node}, path)
    return AttentionShard(path, node, q, k, v, o)


def _one_source_linear(start: torch.fx.Node, path: str, what: str) -> torch.fx.Node:
    """The single linear ``start`` is computed from (walking back until a linear on every path)."""
    found, seen, stack = [], set(), [start]
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if is_call(n, aten.linear.default):
            found.append(n)
        else:
            stack.extend(n.all_input_nodes)
    if len(found) != 1:
        raise PassError(f"{path}: the attention {what} comes from {len(found)} linears, expected one projection")
    return found[0]


def _output_linear(node: torch.fx.Node) -> torch.fx.Node | None:
    n = node
    while True:
        users = list(n.users)
        if len(users) != 1:
            return None
        u = users[0]
        if is_call(u, aten.linear.default) and u.args[0] is n:
            return u
        if not is_call(u, *VIEWS):
            return None
        n = u


def _check_confined(linear: torch.fx.Node, stops: set[torch.fx.Node], path: str) -> None:
    """Everything computed from a column-split ``linear`` ends in ``stops``: no other linear, no output."""
    seen, stack = set(), list(linear.users)
    while stack:
        n = stack.pop()
        if n in seen or n in stops:
            continue
        seen.add(n)
        if n.op == "output" or is_call(n, aten.linear.default):
            raise PassError(f"{path}: {linear.name}'s output also reaches {n.name} besides the layer's "
                            "attention/MLP; splitting it over ranks would change that")
        stack.extend(n.users)


def _mlp(row: torch.fx.Node, taken: set[torch.fx.Node]) -> MLPShard | None:
    """``row`` as the row-parallel end of an MLP, or None (see the module docstring)."""
    columns: list[torch.fx.Node] = []
    inner: set[torch.fx.Node] = set()
    stack = [row.args[0]]
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in inner or n in columns:
            continue
        if is_call(n, aten.linear.default):
            columns.append(n)
        elif is_call(n, *ELEMENTWISE):
            inner.add(n)
            stack.extend(n.all_input_nodes)
        else:
            return None
    if not columns or len({c.args[0] for c in columns}) != 1 or taken.intersection(columns):
        return None
    if any(u is not row and u not in inner for n in (*columns, *inner) for u in n.users):
        return None
    return MLPShard(module_of(row).rpartition(".")[0] or module_of(row), columns, row)
