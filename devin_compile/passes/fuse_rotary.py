"""fuse_rotary: HF's ``rotate_half`` rotary embedding → a roll with a pre-signed sine.

Pattern (``apply_rotary_pos_emb`` with ``rotate_half``, half-split layout)::

    x * cos + cat([-x[..., h:], x[..., :h]], -1) * sin          # h = D / 2

→ ``x * cos + roll(x, h, -1) * sin'``  with  ``sin' = cat([-sin[..., :h], sin[..., h:]], -1)``

since ``cat(-x₂, x₁) · (s₁, s₂) = (x₂, x₁) · (−s₁, s₂)`` elementwise. ``sin'`` depends only
on the step's positions, so after CSE it is built once per step for all layers, and
each q/k rotation costs 4 ops instead of 7. Invariant: bit-identical (negation is exact
and moves between factors of a product; the remaining ops are the same ops in the
same order). Interleaved rotary (pairs of adjacent channels) does not match.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import add_call, commuted, fake_value, is_call, replace_matches
from ..pipeline import Pass, PassContext, PassResult

aten = torch.ops.aten
_END = 2**62


def _half_slice(node, src, first: bool) -> bool:
    """node is src[..., :h] (first) or src[..., h:] on the last dim, h = D/2."""
    if not is_call(node, aten.slice.Tensor) or node.args[0] is not src:
        return False
    v = fake_value(src)
    if v is None:
        return False
    d = v.shape[-1]
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = args[1], args[2] or 0, args[3], args[4] or 1
    if dim not in (-1, v.dim() - 1) or step != 1 or not isinstance(d, int) or d % 2:
        return False
    if first:
        return start == 0 and end == d // 2
    return start == d // 2 and (end is None or end >= d)


def _rotate_half_of(node) -> torch.fx.Node | None:
    """cat([neg(x[..., h:]), x[..., :h]], -1) → x."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    if (node.args[1] if len(node.args) > 1 else 0) not in (-1, fake_value(node).dim() - 1):
        return None
    a, b = node.args[0]
    if not is_call(a, aten.neg.default):
        return None
    x = b.args[0] if is_call(b, aten.slice.Tensor) else None
    if x is None or not _half_slice(a.args[0], x, first=False) or not _half_slice(b, x, first=True):
        return None
    return x


def _match(add: torch.fx.Node):
    """add(mul(x, cos), mul(rotate_half(x), sin)) → (x, cos_mul, rot_mul, sin)."""
    for m1, m2 in commuted(add, aten.add.Tensor):
        if not is_call(m1, aten.mul.Tensor):
            continue
        for rot, sin in commuted(m2, aten.mul.Tensor):
            x = _rotate_half_of(rot) if isinstance(rot, torch.fx.Node) else None
            if x is not None and x in m1.args and isinstance(sin, torch.fx.Node):
                return x, m1, m2, rot, sin
    return None


def _build(graph: torch.fx.Graph, rot_mul: torch.fx.Node, match) -> torch.fx.Node:
    """``roll(x, h) · sin'`` (operands in ``rot_mul``'s order) for ``rot_mul = rotate_half(x) · sin``."""
    x, _cos_mul, _rot_mul, rot, sin = match
    h = fake_value(x).shape[-1] // 2
    s1 = add_call(graph, aten.slice.Tensor, (sin, -1, 0, h), like=rot_mul)
    s2 = add_call(graph, aten.slice.Tensor, (sin, -1, h, _END), like=rot_mul)
    signed = add_call(graph, aten.cat.default, ([add_call(graph, aten.neg.default, (s1,), like=rot_mul), s2], -1),
                      like=rot_mul)
    rolled = add_call(graph, aten.roll.default, (x, [h], [-1]), like=rot_mul)
    args = (rolled, signed) if rot_mul.args[0] is rot else (signed, rolled)
    return add_call(graph, aten.mul.Tensor, args, like=rot_mul)


class FuseRotary(Pass):
    name = "fuse_rotary"

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        # the rewrite replaces the product with rotate_half (inserting before it), not the matched sum
        matches = ((m[2], m) for node in list(gm.graph.nodes) if (m := _match(node)) is not None)
        done = replace_matches(gm, matches, _build)
        return PassResult(matches=done.count, note=f"{done.count} rotary embeddings rewritten; {done.delta(gm)}")
