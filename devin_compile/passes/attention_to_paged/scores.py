"""Walking an eager attention core's scores back to ``q @ kᵀ``: scale, soft-cap, added terms.

``peel_scores(softmax_input)`` → (q, k, scale, softcap, terms) or None, through casts, views,
masks that fill (``masked_fill``, ``where(mask, s, -inf)``) or clamp (XGLM's ``max(s, finfo.min)``),
``+ term`` (masks or position biases, returned for attention_to_paged to classify), ``tanh``
soft-capping, a constant scale (``mul``/``div``, also in place) and the product itself:
``matmul(q, transpose(k))``, ``bmm(q3, transpose(k3))`` or BLOOM's ``baddbmm(bias, q3, transpose(k3),
beta, alpha)`` over [B·H, T, D] reshapes of [1, H, T, D] tensors (``as_4d`` maps those back), or
``einsum("bhqd,bhkd->bhqk", q, k)``. A constant factor on either operand (``q·s`` or ``kᵀ·s`` right
at the product) joins the scale; one applied earlier (XGLM scales the query projection before its
views) stays in q or k, which is the same attention with scale 1.
"""
from __future__ import annotations

import torch
import torch.fx

from ...graph_utils import RESHAPES, is_call, node_shape

aten = torch.ops.aten

_CASTS = (aten.to.dtype, aten._to_copy.default, aten.type_as.default)

_MUL = (aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.mul_.Scalar)
_DIV = (aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.div_.Scalar)


def _peel_scale(x: torch.fx.Node) -> tuple[torch.fx.Node, float | None]:
    """``s * c``, ``c * s``, ``s / c`` (also in place: ``scores /= sqrt(d)``) → (s, scale)."""
    if is_call(x, *_MUL) and isinstance(x.args[1], (int, float)):
        return x.args[0], float(x.args[1])
    if is_call(x, *_MUL) and isinstance(x.args[0], (int, float)):
        return x.args[1], float(x.args[0])
    if is_call(x, *_DIV) and isinstance(x.args[1], (int, float)):
        return x.args[0], 1.0 / float(x.args[1])
    return x, None


def _peel_softcap(x: torch.fx.Node) -> tuple[torch.fx.Node, float]:
    """mul(tanh(div(s, cap)), cap) → (s, cap)."""
    if is_call(x, aten.mul.Tensor) and isinstance(x.args[1], (int, float)) and is_call(x.args[0], aten.tanh.default):
        inner = x.args[0].args[0]
        if is_call(inner, aten.div.Tensor) and inner.args[1] == x.args[1]:
            return inner.args[0], float(x.args[1])
    return x, 0.0


def _transposed_last(kt: object) -> torch.fx.Node | None:
    """transpose(k, -2, -1) (any spelling of the last two dims) → k."""
    if not is_call(kt, aten.transpose.int):
        return None
    nd = len(node_shape(kt) or (0, 0, 0, 0))
    return kt.args[0] if sorted(a % nd for a in kt.args[1:3]) == [nd - 2, nd - 1] else None


def as_4d(x: object) -> torch.fx.Node | None:
    """A [1, H, T, D] node as is; a [H, T, D] ``reshape``/``view`` of one (BLOOM's batch·heads bmm) → that one."""
    shape = node_shape(x) if isinstance(x, torch.fx.Node) else None
    if shape is not None and len(shape) == 4:
        return x
    if shape is not None and len(shape) == 3 and is_call(x, *RESHAPES):
        base = node_shape(x.args[0])
        if base is not None and len(base) == 4 and base[0] == 1 and base[1] == shape[0]:
            return x.args[0]
    return None


def einsum_operands(x: object, product: str) -> tuple | None:
    """The two operands of a head-first 4-D ``einsum``: ``product="qk"`` for ``"abid,abjd->abij"``
    (the scores), ``"pv"`` for ``"abij,abjd->abid"`` (probabilities times values); else None."""
    if not is_call(x, aten.einsum.default) or len(x.args[1]) != 2:
        return None
    spec = x.args[0].replace(" ", "")
    ins, _, out = spec.partition("->")
    a, _, b = ins.partition(",")
    if not (len(a) == len(b) == len(out) == 4 and a[:2] == b[:2] == out[:2] and len(set(a + b)) == 5):
        return None
    ok = (a[3] == b[3] and out[2:] == a[2] + b[2]) if product == "qk" else (a[3] == b[2] and out[2:] == a[2] + b[3])
    return tuple(x.args[1]) if ok else None


def _const_factor(x: object) -> tuple[object, float]:
    """``y·c`` / ``c·y`` / ``y / c`` (c a number) → (y, c); anything else → (x, 1)."""
    y, c = _peel_scale(x) if isinstance(x, torch.fx.Node) else (x, None)
    return (y, c) if c is not None else (x, 1.0)


def _is_qk_matmul(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float, list] | None:
    """The scores' product → (q, k, factor, terms): matmul(q, kᵀ) and einsum → (q, k, 1, []);
    bmm(q3, kᵀ3) likewise over [H, T, D] views; baddbmm(bias, q3, kᵀ3, beta=b, alpha=a) → (q, k, a,
    [(bias, b)]). A constant factor on q or kᵀ right at the product is peeled into the factor."""
    pair = einsum_operands(x, "qk")
    if pair is not None:
        (q, cq), (k, ck) = _const_factor(pair[0]), _const_factor(pair[1])
        return q, k, cq * ck, []
    if not is_call(x, aten.matmul.default, aten.bmm.default, aten.baddbmm.default):
        return None
    bias = x.args[0] if is_call(x, aten.baddbmm.default) else None
    (q, cq), (kt, ck) = (_const_factor(a) for a in (x.args[1:3] if bias is not None else x.args[:2]))
    k = _transposed_last(kt)
    if k is not None:
        k, c = _const_factor(k)
        ck *= c
    if is_call(x, aten.matmul.default):
        return (q, k, cq * ck, []) if k is not None else None
    q4, k4 = as_4d(q), as_4d(k) if k is not None else None
    if q4 is None or k4 is None:
        return None
    if bias is None:
        return q4, k4, cq * ck, []
    beta, alpha = x.kwargs.get("beta", 1.0), x.kwargs.get("alpha", 1.0)
    return q4, k4, float(alpha) * cq * ck, [(bias, float(beta))]


_MASKED_FILL = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
_MASK_FLOOR = -1e30  # a fill or clamp at or below this only hides keys (finfo.min, -inf)


def _very_negative(v: object) -> bool:
    """A number, or a ``full([], v)`` scalar tensor, at or below ``_MASK_FLOOR``."""
    if is_call(v, aten.full.default) and list(v.args[0]) == []:
        v = v.args[1]
    return isinstance(v, (int, float)) and v <= _MASK_FLOOR


def _unmasked(x: torch.fx.Node) -> torch.fx.Node | None:
    """The scores under a mask that fills or clamps hidden entries, else None: ``masked_fill``,
    ``where(mask, s, fill)``, ``max(s, finfo.min)``, ``clamp_min(s, finfo.min)``."""
    if is_call(x, *_MASKED_FILL):
        return x.args[0]
    if is_call(x, aten.where.self, aten.where.ScalarOther) and _very_negative(x.args[2]):
        return x.args[1]
    if is_call(x, aten.maximum.default, aten.max.other, aten.clamp_min.default) and _very_negative(x.args[1]):
        return x.args[0]
    if is_call(x, aten.clamp.default) and len(x.args) > 1 and _very_negative(x.args[1]) and (
            len(x.args) < 3 or x.args[2] is None):
        return x.args[0]
    return None


def peel_scores(x: object) -> tuple[torch.fx.Node, torch.fx.Node, float | None, float, list] | None:
    """Softmax input → (q, k, scale, softcap, additive terms), walking back through casts, views,
    ``masked_fill`` (a mask, checked by capture's mask probe), ``+ term`` (mask or bias), the
    soft-cap and the scale to ``q @ kᵀ`` (or BLOOM's ``baddbmm``)."""
    terms: list = []
    while isinstance(x, torch.fx.Node):
        if is_call(x, *_CASTS, *RESHAPES):
            x = x.args[0]
            continue
        if _unmasked(x) is not None:
            x = _unmasked(x)
            continue
        if is_call(x, aten.add.Tensor) and all(isinstance(a, torch.fx.Node) for a in x.args[:2]):
            a, b = x.args[:2]
            if peel_scores(a) is not None:
                terms.append((b, 1.0))
                x = a
            elif peel_scores(b) is not None:
                terms.append((a, 1.0))
                x = b
            else:
                return None
            continue
        break
    if not isinstance(x, torch.fx.Node):
        return None
    x, softcap = _peel_softcap(x)
    x, scale = _peel_scale(x)
    qk = _is_qk_matmul(x)
    if qk is None:
        return None
    q, k, alpha, inner = qk
    if alpha != 1.0:
        scale = alpha * (1.0 if scale is None else scale)
    return q, k, scale, softcap, terms + inner
