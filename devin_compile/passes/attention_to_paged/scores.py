"""Walking an eager attention core's scores back to ``q @ kᵀ``: scale, soft-cap, added terms.

``peel_scores(softmax_input)`` → (q, k, scale, softcap, terms) or None, through casts, views,
``masked_fill`` masks, ``+ term`` (masks or position biases, returned for attention_to_paged to
classify), ``tanh`` soft-capping, a constant scale (``mul``/``div``, also in place) and
``matmul(q, transpose(k))`` or BLOOM's ``baddbmm(bias, q3, transpose(k3), beta, alpha)`` over
[B·H, T, D] reshapes of [1, H, T, D] tensors (``as_4d`` maps those back).
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


def _is_qk_matmul(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float, list] | None:
    """matmul(q, kᵀ) → (q, k, 1, []); baddbmm(bias, q, kᵀ, beta=b, alpha=a) → (q, k, a, [(bias, b)])."""
    if is_call(x, aten.matmul.default):
        q, kt = x.args
        k = _transposed_last(kt)
        return (q, k, 1.0, []) if k is not None else None
    if is_call(x, aten.baddbmm.default):
        bias, q, kt = x.args[:3]
        beta, alpha = x.kwargs.get("beta", 1.0), x.kwargs.get("alpha", 1.0)
        k, q4 = _transposed_last(kt), as_4d(q)
        k4 = as_4d(k) if k is not None else None
        if q4 is None or k4 is None:
            return None
        return q4, k4, float(alpha), [(bias, float(beta))]
    return None


_MASKED_FILL = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)


def peel_scores(x: object) -> tuple[torch.fx.Node, torch.fx.Node, float | None, float, list] | None:
    """Softmax input → (q, k, scale, softcap, additive terms), walking back through casts, views,
    ``masked_fill`` (a mask, checked by capture's mask probe), ``+ term`` (mask or bias), the
    soft-cap and the scale to ``q @ kᵀ`` (or BLOOM's ``baddbmm``)."""
    terms: list = []
    while isinstance(x, torch.fx.Node):
        if is_call(x, *_CASTS, *RESHAPES) or is_call(x, *_MASKED_FILL):
            x = x.args[0]
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
