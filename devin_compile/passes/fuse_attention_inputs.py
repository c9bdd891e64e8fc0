"""fuse_attention_inputs: paged attention's q/k/v input chains → one ``devin::rotary_heads`` call.

Pattern (HF's ``q_proj(x).view(1, T, -1, D).transpose(1, 2)`` + rotary, after
:mod:`.attention_to_paged`, :mod:`.fuse_rotary` and :mod:`.cleanup`, whose CSE leaves one
cos and one sin per step), per attention layer::

    heads(p)   = transpose(view(p, [1, T, H, D]), 1, 2)                        # [1, H, T, D]
    rot(x)     = x * cos + roll(x, D/2, -1) * sin                             # either operand order
    q' = squeeze(transpose(rot(heads(q_flat)), 1, 2), 0)                       # [T, Hq, D]
    k' = squeeze(transpose(rot(heads(k_flat)), 1, 2), 0)                       # same cos, sin
    v' = squeeze(view(v_flat, [1, T, Hkv, D]), 0)
    paged_attention(q', k', v', ...)

→ ``q', k', v' = devin::rotary_heads(q_flat, k_flat, v_flat, cos, sin, D)`` (the flats may be
slices of a fused projection). About 20 dispatched ops per layer become one; on CPU the op's
C++ kernel (loaded here) does the work in a single pass. Invariant: bit-identical (the op
rounds after each multiply and the add, like the aten ops it replaces; tested). Layers whose
chain differs (a q/k norm between the view and the transpose, partial rotary, no rotary)
are left alone, and the note says how many matched.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import (RESHAPES, add_call, commuted, counted_nodes, eliminate_dead_code, fake_value, has_shape,
                           is_call, node_delta, transpose_dims)
from ..ops import rotary_heads as rotary_heads_op  # registers devin::rotary_heads
from ..pipeline import Pass, PassContext, PassResult

aten = torch.ops.aten


def _split_heads(x) -> tuple[torch.fx.Node, int] | None:
    """view(flat, [1, T, H, D]) → (flat, D) when flat is [1, T, H·D]."""
    if not is_call(x, *RESHAPES):
        return None
    flat, v = x.args[0], fake_value(x)
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or not statically_known_true(v.shape[0] == 1):
        return None
    t, h, d = v.shape[1:]
    if not isinstance(d, int) or not isinstance(h, int) or not has_shape(flat, (1, t, h * d)):
        return None
    return flat, d


def _heads(x) -> tuple[torch.fx.Node, int] | None:
    """transpose(view(flat, [1, T, H, D]), 1, 2) → (flat, D)."""
    if not is_call(x, aten.transpose.int) or transpose_dims(x) != [1, 2]:
        return None
    return _split_heads(x.args[0])


def _rotary(r) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """x * cos + roll(x, D/2, -1) * sin → (x, cos, sin)."""
    if not isinstance(r, torch.fx.Node) or r.kwargs:
        return None
    for m1, m2 in commuted(r, aten.add.Tensor):
        if not is_call(m1, aten.mul.Tensor):
            continue
        for roll, sin in commuted(m2, aten.mul.Tensor):
            if not is_call(roll, aten.roll.default) or not isinstance(sin, torch.fx.Node):
                continue
            x = roll.args[0]
            d = fake_value(x).shape[-1]
            shifts, dims = list(roll.args[1]), list(roll.args[2]) if len(roll.args) > 2 else []
            if shifts != [d // 2] or dims not in ([-1], [3]) or x not in m1.args:
                continue
            cos = m1.args[1] if m1.args[0] is x else m1.args[0]
            if isinstance(cos, torch.fx.Node):
                return x, cos, sin
    return None


def _rotated_input(node):
    """squeeze(transpose(rot(heads(flat)), 1, 2), 0) → (flat, D, cos, sin)."""
    if not is_call(node, aten.squeeze.dim) or node.args[1] != 0:
        return None
    t = node.args[0]
    if not is_call(t, aten.transpose.int) or transpose_dims(t) != [1, 2]:
        return None
    rot = _rotary(t.args[0])
    if rot is None:
        return None
    x, cos, sin = rot
    heads = _heads(x)
    if heads is None:
        return None
    flat, d = heads
    tv = fake_value(x).shape[2]
    for table in (cos, sin):  # one row of D per token: [1, 1, T, D]
        if not has_shape(table, (1, 1, tv, d)) or fake_value(table).dtype != fake_value(x).dtype:
            return None
    return flat, d, cos, sin


def _match(attn: torch.fx.Node):
    """paged_attention(q', k', v', ...) → (q_flat, k_flat, v_flat, cos, sin, D) or None."""
    if not is_call(attn, torch.ops.devin.paged_attention.default):
        return None
    q_in, k_in, v_in = attn.args[:3]
    q, k = _rotated_input(q_in), _rotated_input(k_in)
    if q is None or k is None or q[1:] != k[1:]:
        return None
    if not is_call(v_in, aten.squeeze.dim) or v_in.args[1] != 0:
        return None
    v = _split_heads(v_in.args[0])
    if v is None:
        return None
    dtypes = {fake_value(n).dtype for n in (q[0], k[0], v[0])}
    if len(dtypes) != 1:
        return None
    # the op's outputs must have the shapes attention read before: [T, H, D]
    d = q[1]
    t, kv_heads = fake_value(q_in).shape[0], fake_value(k_in).shape[1]
    want = {q_in: (t, fake_value(q[0]).shape[-1] // d, d), k_in: (t, kv_heads, d),
            v_in: (t, kv_heads, fake_value(v[0]).shape[-1] // kv_heads)}
    if not all(has_shape(n, shape) for n, shape in want.items()):
        return None
    return q[0], k[0], v[0], q[2], q[3], d


class FuseAttentionInputs(Pass):
    name = "fuse_attention_inputs"
    requires = ("attention_to_paged", "fuse_rotary", "cleanup")

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        graph = gm.graph
        before = counted_nodes(gm)
        count = layers = 0
        for node in list(graph.nodes):
            if not is_call(node, torch.ops.devin.paged_attention.default):
                continue
            layers += 1
            m = _match(node)
            if m is None:
                continue
            q, k, v, cos, sin, d = m
            with graph.inserting_before(node):
                if fake_value(q).device.type == "cpu":
                    rotary_heads_op.load_cpu_kernel()
                heads = add_call(graph, torch.ops.devin.rotary_heads.default, (q, k, v, cos, sin, d), like=node)
                outs = [add_call(graph, operator.getitem, (heads, i), like=node) for i in range(3)]
            node.args = (*outs, *node.args[3:])
            count += 1
        eliminate_dead_code(gm)
        return PassResult(matches=count,
                          note=f"{count} of {layers} attention layers take rotary_heads; {node_delta(gm, before)}")
