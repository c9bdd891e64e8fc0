"""HF's routed-experts subgraph, as exported on CPU (``transformers.grouped_mm_fallback``): where each
expert block's chain starts and what it reads (``fuse_moe_experts`` fuses it, ``shard_tensor_parallel``
splits it). The chain, with ``ids``/``w`` the router's top-k indices and weights [T, k] and ``x`` the
block's rows [T, H]::

    ids_g, perm = sort(reshape(ids, [-1]));  xs = index(x, [perm // k]);  ws = index(reshape(w, [-1]), [perm])
    offs = cumsum(histc(float(ids_g), E, 0, E-1), dtype=int32)
    g, u = chunk(grouped_mm_fallback(xs, transpose(W_gate_up), offs), 2, -1)        # W_gate_up [E, 2F, H]
    y = grouped_mm_fallback(silu(g) * u, transpose(W_down), offs) * unsqueeze(ws, -1) # W_down [E, H, F]
    out = sum(view(index(y, [inverse(perm)]), [T, k, H]), [1])

:func:`match_experts` reads one block from its gate/up GEMM or raises :class:`NoMatch` saying where
the graph differs; :func:`expert_blocks` does so for every block of a graph.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from .graph_utils import fake_value, grouped_mm_fallback_op, is_call, is_expert_transpose, transposed_expert_weight

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)


@dataclass
class ExpertChain:
    x: torch.fx.Node
    ids: torch.fx.Node
    weights: torch.fx.Node
    gate_up: torch.Tensor
    down: torch.Tensor
    out: torch.fx.Node  # the slot sum the op replaces
    inverse: torch.fx.Node  # index_put_ into a fresh buffer: DCE keeps in-place ops, so it is erased here
    down_gemm: torch.fx.Node  # the grouped down GEMM (shard_tensor_parallel splits its weight)


class NoMatch(Exception):
    """Why a grouped gate/up GEMM is not the head of HF's experts chain (said in the report)."""


def _uncast(node):
    """Skip value-preserving casts (``to`` the dtype the value already has)."""
    while is_call(node, *_CASTS) and getattr(fake_value(node), "dtype", None) == \
            getattr(fake_value(node.args[0]), "dtype", 1):
        node = node.args[0]
    return node


def _item(node, index: int):
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem \
            and node.args[1] == index:
        return node.args[0]
    return None


def _only_user(node: torch.fx.Node, what: str) -> torch.fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise NoMatch(f"{what} has {len(users)} users")
    return users[0]


def _flat(node, what: str) -> torch.fx.Node:
    """``reshape(t, [-1])`` / ``view(t, [-1])`` → t."""
    if not (is_call(node, aten.reshape.default, aten.view.default) and list(node.args[1]) == [-1]):
        raise NoMatch(f"{what} is not a flattened [T, k] tensor")
    return node.args[0]


def _expert_weight(gm, node, what: str) -> torch.Tensor:
    if not is_expert_transpose(node):
        raise NoMatch(f"{what} weight is not transpose(W[E, out, in]) (transposed expert layout)")
    w = transposed_expert_weight(gm, node)
    if w is None:
        raise NoMatch(f"{what} weight is not a 3-D parameter")
    return w


def match_experts(gm: torch.fx.GraphModule, gate_up: torch.fx.Node, grouped=None) -> ExpertChain:
    """The whole experts chain from its first grouped GEMM, or :class:`NoMatch` saying where it differs."""
    grouped = grouped or grouped_mm_fallback_op()
    x, perm, k, ids, w_gu, offs = _routed_rows(gm, gate_up)
    down, w_d = _gated_experts(gm, gate_up, grouped, offs, w_gu)
    weights, out, inverse = _weighted_slot_sum(down, perm, k, w_gu.shape[2])
    return ExpertChain(x, ids, weights, w_gu, w_d, out, inverse, down)


def _routed_rows(gm: torch.fx.GraphModule, gate_up: torch.fx.Node):
    """The gate/up GEMM's input: rows of x gathered in expert order, with the expert offsets
    → (x, perm, k, ids, W_gate_up, offs)."""
    gather = _uncast(gate_up.args[0])
    if not (is_call(gather, aten.index.Tensor) and len(gather.args[1]) == 1
            and is_call(gather.args[1][0], aten.floor_divide.default)):
        raise NoMatch("gate/up input is not a gather of token rows index(x, [perm // k])")
    x = gather.args[0]
    if getattr(fake_value(x), "ndim", 0) != 2:
        raise NoMatch("the gathered rows are not a [T, H] tensor")
    perm, k = gather.args[1][0].args
    sort = _item(perm, 1)
    if not is_call(sort, aten.sort.default) or len(sort.args) != 1:
        raise NoMatch("rows are not sorted by expert id")
    ids = _flat(sort.args[0], "the expert ids")
    w_gu = _expert_weight(gm, gate_up.args[1], "gate/up")
    n_experts, f2, hidden = w_gu.shape
    ids_val = fake_value(ids)
    if ids_val is None or ids_val.dim() != 2 or not isinstance(k, int) or ids_val.shape[1] != k:
        raise NoMatch("expert ids are not [T, k]")
    offs = gate_up.args[2]
    histc = offs.args[0] if is_call(offs, aten.cumsum.default) else None
    counted = histc.args[0] if is_call(histc, aten.histc.default) else None
    counted = counted.args[0] if is_call(counted, *_CASTS) else counted  # histc counts float ids on CPU
    if not (_item(counted, 0) is sort
            and list(histc.args[1:4]) == [n_experts, 0, n_experts - 1]):
        raise NoMatch(f"expert offsets are not cumsum(histc(sorted ids, {n_experts}, 0, {n_experts - 1}))")
    return x, perm, k, ids, w_gu, offs


def _gated_experts(gm: torch.fx.GraphModule, gate_up: torch.fx.Node, grouped, offs: torch.fx.Node,
                   w_gu: torch.Tensor) -> tuple[torch.fx.Node, torch.Tensor]:
    """chunk → silu(gate) · up → the grouped down GEMM over the same offsets → (down node, W_down)."""
    n_experts, f2, hidden = w_gu.shape
    chunk = _only_user(gate_up, "the gate/up GEMM")
    if not (is_call(chunk, aten.chunk.default) and chunk.args[1] == 2 and chunk.args[2] in (-1, 1)):
        raise NoMatch(f"gate/up output goes to {chunk.target}, not chunk(…, 2, -1) (no gate, or an expert bias)")
    halves = {i: [u for u in chunk.users if _item(u, i) is chunk] for i in (0, 1)}
    if any(len(h) != 1 for h in halves.values()):
        raise NoMatch("gate/up halves are not read once each")
    gate, up = halves[0][0], halves[1][0]
    act = _only_user(gate, "the gate half")
    if not is_call(act, aten.silu.default):
        raise NoMatch(f"expert activation is {act.target}, not SiLU")
    mul = _only_user(act, "the activation")
    if not (is_call(mul, aten.mul.Tensor) and set(mul.args) == {act, up} and len(up.users) == 1):
        raise NoMatch("activation is not multiplied by the up half")
    down = next((u for u in _users_through_casts(mul) if is_call(u, grouped)), None)
    if down is None or down.args[2] is not offs or len(_users_through_casts(mul)) != 1:
        raise NoMatch("act(gate)·up does not feed one grouped down GEMM over the same offsets")
    w_d = _expert_weight(gm, down.args[1], "down")
    if tuple(w_d.shape) != (n_experts, hidden, f2 // 2) or f2 % 2:
        raise NoMatch(f"down weight {tuple(w_d.shape)} does not match gate/up {tuple(w_gu.shape)}")
    return down, w_d


def _weighted_slot_sum(down: torch.fx.Node, perm: torch.fx.Node, k: int, hidden: int):
    """× the sorted routing weights → back in token order → summed over the k slots
    → (routing weights [T, k], the slot sum, the inverse permutation)."""
    scale = _only_user(down, "the down GEMM")
    other = next((a for a in scale.args if a is not down), None) if is_call(scale, aten.mul.Tensor) else None
    sorted_w = other.args[0] if is_call(other, aten.unsqueeze.default) and other.args[1] in (-1, 1) else None
    if not (is_call(sorted_w, aten.index.Tensor) and list(sorted_w.args[1]) == [perm]):
        raise NoMatch(f"down output goes to {scale.target}, not a product with the sorted routing weights "
                       "(expert bias or post-expert norm)")
    weights = _flat(sorted_w.args[0], "the routing weights")
    unsort = _only_user(scale, "the weighted expert output")
    inverse = unsort.args[1][0] if is_call(unsort, aten.index.Tensor) and len(unsort.args[1]) == 1 else None
    if not (is_call(inverse, aten.index_put_.default) and list(inverse.args[1]) == [perm]
            and is_call(inverse.args[0], aten.empty_like.default) and inverse.args[0].args[0] is perm
            and is_call(inverse.args[2], aten.arange.default, aten.arange.start)):
        raise NoMatch("weighted rows are not put back in token order by the inverse permutation")
    view = _only_user(unsort, "the unsorted rows")
    out = _only_user(view, "the [T, k, H] view") if is_call(view, aten.view.default, aten.reshape.default) else None
    if not (is_call(out, aten.sum.dim_IntList) and list(out.args[1]) == [1]
            and tuple(getattr(fake_value(view), "shape", ())[1:]) == (k, hidden)):
        raise NoMatch("the k slots are not summed by view(T, k, H).sum(1)")
    if fake_value(weights) is None or tuple(fake_value(weights).shape[1:]) != (k,):
        raise NoMatch("routing weights are not [T, k]")
    return weights, out, inverse


def _users_through_casts(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of ``node``, looking through value-preserving casts."""
    out = []
    for u in node.users:
        out.extend(_users_through_casts(u) if _uncast(u) is node and u is not node else [u])
    return out


def expert_blocks(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, ExpertChain | str]]:
    """Each expert block's gate/up GEMM with its matched chain, or why the chain differs from HF's
    (``fuse_moe_experts`` fuses them, ``shard_tensor_parallel`` splits them)."""
    out: list[tuple[torch.fx.Node, ExpertChain | str]] = []
    for gate_up in gate_up_gemms(gm.graph):
        try:
            out.append((gate_up, match_experts(gm, gate_up)))
        except NoMatch as e:
            out.append((gate_up, str(e)))
    return out


def gate_up_gemms(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The first grouped GEMM over each expert-offsets node: an expert block's gate/up."""
    grouped = grouped_mm_fallback_op()
    heads: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if is_call(node, grouped):
            heads.setdefault(node.args[2], node)
    return list(heads.values())
