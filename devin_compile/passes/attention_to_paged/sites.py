"""Finding attention_to_paged's sites: each attention core's output, q, k, v, scale, soft-cap and the
terms added to its scores (SDPA or the eager softmax form), and undoing ``repeat_kv`` on k and v."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ...graph_utils import RESHAPES, add_call, is_call, node_shape
from ...pipeline import PassError
from .scores import as_4d, einsum_operands, peel_scores
from .sinks import drop_sink_column, peel_sink

aten = torch.ops.aten

_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.type_as.default)
_DROPOUT = (aten.dropout.default,)


@dataclass
class AttentionSite:
    output: torch.fx.Node  # the node whose value is attention's [1, Hq, T, Dv] result
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    scale: float | None
    softcap: float
    form: str  # "sdpa" | "eager"
    # (node, coefficient, ndim-of-scores) terms added to the scaled scores: masks, or an ALiBi bias
    bias_terms: list = None
    sink: torch.fx.Node | None = None  # the extra softmax column of attention sinks (sinks.py)


# torch.export's metadata checks (e.g. after ``softmax(..., dtype=float32).to(float32)``):
# they read a value without using it, so they do not count as users when walking a pattern.
_ASSERTS = (aten._assert_tensor_metadata.default, aten._assert_scalar.default)


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one real (non-assert) user of ``node``, or None."""
    users = [u for u in node.users if not is_call(u, *_ASSERTS)]
    return users[0] if len(users) == 1 else None


def _match_sdpa(node: torch.fx.Node) -> AttentionSite | None:
    if not is_call(node, aten.scaled_dot_product_attention.default):
        return None
    q, k, v = node.args[:3]
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if dropout:
        raise PassError(f"{node.name}: scaled_dot_product_attention with dropout_p={dropout}; call model.eval()")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    terms = [(mask, 1.0)] if isinstance(mask, torch.fx.Node) else []
    return AttentionSite(node, q, k, v, node.kwargs.get("scale"), 0.0, "sdpa", terms)


def _match_eager(node: torch.fx.Node) -> AttentionSite | None:
    ndim = len(node_shape(node) or ())
    if not is_call(node, *_SOFTMAX) or ndim == 0 or node.args[1] % ndim != ndim - 1:
        return None
    # Forward: softmax → [sink column dropped] → [cast] → [dropout] → matmul(·, v)
    cur, sliced = node, False
    while True:
        nxt = _single_user(cur)
        if nxt is None:
            return None
        if cur is node and drop_sink_column(nxt):
            cur, sliced = nxt, True
            continue
        if is_call(nxt, *_CASTS):
            cur = nxt
            continue
        if is_call(nxt, *_DROPOUT):
            if nxt.args[1] and (len(nxt.args) < 3 or nxt.args[2]):
                raise PassError(f"{nxt.name}: attention dropout in training mode; call model.eval()")
            cur = nxt
            continue
        if is_call(nxt, *RESHAPES):  # BLOOM: probs viewed to [B·H, T, T] for a bmm
            cur = nxt
            continue
        break
    pair = einsum_operands(nxt, "pv")
    if is_call(nxt, aten.matmul.default) and nxt.args[0] is cur:
        pv, v = nxt, nxt.args[1]
    elif pair is not None and pair[0] is cur:
        pv, v = nxt, pair[1]
    elif is_call(nxt, aten.bmm.default) and nxt.args[0] is cur:
        # [H, T, Dv] = bmm(probs, v3): the site's output is its view back to [1, H, T, Dv]
        pv, v = _single_user(nxt), as_4d(nxt.args[1])
        if pv is None or v is None or as_4d(pv) is not pv or not is_call(pv, *RESHAPES):
            return None
    else:
        return None
    # Backward: [cat(·, sink)] [− row max] ← scores [+ mask/bias] ← [softcap] ← [· scale] ← matmul(q, kᵀ)
    # | baddbmm(bias, q, kᵀ)
    split = peel_sink(node.args[0], sliced)
    peeled = peel_scores(split[0]) if split is not None else None
    if peeled is None:
        return None
    q, k, scale, softcap, terms = peeled
    return AttentionSite(pv, q, k, v, 1.0 if scale is None else scale, softcap, "eager", terms, split[1])


def _skip_full_slices(x: torch.fx.Node) -> torch.fx.Node:
    """``x[:, :, :]``-style slices (start 0, end past the end, step 1) are identities."""
    while is_call(x, aten.slice.Tensor):
        args = list(x.args) + [None] * (5 - len(x.args))
        start, end, step = args[2], args[3], args[4]
        if start not in (None, 0) or step not in (None, 1) or not (end is None or (isinstance(end, int) and end >= 2**62)):
            break
        x = x.args[0]
    return x


def strip_repeat_kv(x: torch.fx.Node, num_kv_heads: int) -> torch.fx.Node:
    """reshape(expand(unsqueeze(kv, 2), ...)) or repeat_interleave(kv, n, 1) → kv."""
    if is_call(x, *RESHAPES) and is_call(x.args[0], aten.expand.default):
        base = _skip_full_slices(x.args[0].args[0])
        if is_call(base, aten.unsqueeze.default) and base.args[1] == 2:
            return base.args[0]
    if is_call(x, aten.repeat_interleave.self_int) and (x.args[2] if len(x.args) > 2 else x.kwargs.get("dim")) == 1:
        return x.args[0]
    return x


def find_attention_sites(gm: torch.fx.GraphModule) -> list[AttentionSite]:
    sites = []
    for node in gm.graph.nodes:
        site = _match_sdpa(node) or _match_eager(node)
        if site is not None:
            sites.append(site)
    return sites


def flat_heads(graph: torch.fx.Graph, x: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """[1, H, T, D] → [T, H, D] (``squeeze(transpose(x, 1, 2), 0)``), the layout the paged ops take."""
    return add_call(graph, aten.squeeze.dim, (add_call(graph, aten.transpose.int, (x, 1, 2), like=like), 0), like=like)


def batched_heads(graph: torch.fx.Graph, out: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """[T, H, D] → [1, H, T, D] (``transpose(unsqueeze(out, 0), 1, 2)``), the layout attention returned."""
    return add_call(graph, aten.transpose.int, (add_call(graph, aten.unsqueeze.default, (out, 0), like=like), 1, 2),
                    like=like)
