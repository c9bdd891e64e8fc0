"""Attention sinks: a learned logit per head that joins the softmax's denominator (gpt-oss).

Hugging Face's eager spelling::

    combined = cat([scores, sinks.reshape(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values    # an overflow guard
    probs = softmax(combined, dim=-1)[..., :-1]                         # the sink's column dropped

so each row's weights are ``exp(s_j) / (exp(sink_h) + Σ_k exp(s_k))``: the sink attends to nothing.
``drop_sink_column`` recognises the slice after the softmax, ``peel_sink`` the concatenation before
it (and the row-max shift, which softmax ignores, with or without sinks), and ``fit_sinks`` reads the
column on the probe, as ``alibi.py`` reads a bias: it must be one finite logit per head, the same for
every query, and must not depend on the tokens; else a ``PassError`` naming the layer.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ...graph_utils import is_call, node_shape
from ...pipeline import PassError
from .alibi import SubgraphEvaluator

aten = torch.ops.aten


def _last_dim(node: torch.fx.Node, dim: object) -> bool:
    nd = len(node_shape(node) or ())
    return isinstance(dim, int) and nd > 0 and dim % nd == nd - 1


def drop_sink_column(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``probs[..., :-1]`` (a slice of the last dim from 0 to -1, step 1)."""
    if not is_call(node, aten.slice.Tensor):
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    src, dim, start, end, step = args[:5]
    return _last_dim(src, dim) and start in (None, 0) and end == -1 and step in (None, 1)


def _row_max_of(m: object, x: torch.fx.Node) -> bool:
    """``m`` is ``max(x, -1, keepdim=True).values`` or ``amax(x, -1, keepdim=True)`` (maybe detached)."""
    if is_call(m, aten.detach.default, aten.alias.default):
        m = m.args[0]
    if is_call(m, aten.amax.default):
        dims = m.args[1] if len(m.args) > 1 else m.kwargs.get("dim")
        keep = m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False)
        return m.args[0] is x and keep and list(dims) in ([-1], [len(node_shape(x) or ()) - 1])
    if is_call(m, operator.getitem) and m.args[1] == 0 and is_call(m.args[0], aten.max.dim):
        mx = m.args[0]
        keep = mx.args[2] if len(mx.args) > 2 else mx.kwargs.get("keepdim", False)
        return mx.args[0] is x and _last_dim(x, mx.args[1]) and keep
    return False


def peel_sink(x: object, sliced: bool) -> tuple[object, torch.fx.Node | None] | None:
    """Softmax input → (scores, sink column node or None): drops a row-max shift, then (when the
    softmax's last column is ``sliced`` off) splits ``cat([scores, sink], -1)``. None when the slice
    and the concatenation do not pair up (a shape this pass cannot serve)."""
    if is_call(x, aten.sub.Tensor) and isinstance(x.args[0], torch.fx.Node) and _row_max_of(x.args[1], x.args[0]):
        x = x.args[0]
    if not sliced:
        return x, None
    if not is_call(x, aten.cat.default) or len(x.args[0]) != 2:
        return None
    dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    scores, sink = x.args[0]
    sink_shape = node_shape(sink)
    if not _last_dim(x, dim) or sink_shape is None or sink_shape[-1] != 1:
        return None
    return scores, sink


def _reads_tokens(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value depends on a graph input's values (sizes read by ``sym_size`` do not count)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or is_call(n, aten.sym_size.int):
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        stack.extend(n.all_input_nodes)
    return False


def fit_sinks(ev: SubgraphEvaluator, sink: torch.fx.Node, num_heads: int, where: str) -> torch.Tensor:
    """The sink column ([1, H, P, 1] on the probe, a view/expand of a [H] parameter) → its logits [num_heads]
    float32; a ``PassError`` unless it is one finite logit per head, the same for every query and token."""
    if _reads_tokens(sink):
        raise PassError(f"{where}: the extra softmax column (attention sink) depends on the tokens; the paged "
                        "runtime serves only a learned logit per head")
    val = ev.value(sink)
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or val.shape[0] != 1 or val.shape[-1] != 1:
        raise PassError(f"{where}: an extra softmax column of shape {getattr(val, 'shape', None)}, expected "
                        "[1, heads, queries, 1] (one sink logit per head)")
    rows = val.detach()[0, :, :, 0].double()  # [H, P or 1]
    if not bool(torch.isfinite(rows).all()) or float((rows - rows[:, :1]).abs().max()) > 0:
        raise PassError(f"{where}: the attention sink logits are not finite or differ between queries; the paged "
                        "runtime serves one constant logit per head")
    sinks = rows[:, 0].float()
    if sinks.numel() == 1:
        sinks = sinks.expand(num_heads)
    if sinks.numel() != num_heads:
        raise PassError(f"{where}: {sinks.numel()} attention sink logits, expected {num_heads} query heads")
    return sinks.contiguous()


__all__ = ["drop_sink_column", "fit_sinks", "peel_sink"]
