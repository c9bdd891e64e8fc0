"""attention_to_paged: every attention core → one ``devin::paged_attention`` call.

Pattern (either form, on the captured ATen graph)::

    sdpa(q, repeat_kv(k), repeat_kv(v), mask, scale=s)                       # SDPA form
    matmul(dropout(softmax(softcap(matmul(q, kᵀ)·s) + mask).to(dt)), repeat_kv(v))   # eager form

where ``repeat_kv`` is ``reshape(expand(unsqueeze(x, 2)))`` or ``repeat_interleave``
(or absent, or SDPA's ``enable_gqa``), and the soft-cap and dropout (p=0 in eval)
are optional.

Replacement, with q [1,Hq,T,D] and the *un-repeated* k, v [1,Hkv,T,D]::

    transpose(unsqueeze(paged_attention(q', k', v', layer, s, cap, window), 0), 1, 2)
    where x' = squeeze(transpose(x, 1, 2), 0)    # [T, H, D]

The op writes k/v into the paged cache and attends over each sequence's cached
tokens using per-step metadata from the runtime context; the mask-building subgraph
becomes dead and is removed. Invariant: the number of rewrites equals the number of
attention layers; otherwise the pass fails naming the layers it missed.

Matching details that hold across families:

- export's metadata asserts (``_assert_tensor_metadata`` on the softmax output) are not
  counted as users when walking softmax → cast → dropout → matmul;
- the scale may be ``mul``/``div`` by a constant, also in place (Falcon's ``scores /= √d``);
- the key may be broadcast rather than repeated (multi-query ``q @ kᵀ`` with one KV head);
- each site is assigned to its layer through ``ModelInfo.attention_modules`` (the
  innermost enclosing attention module), so layer naming (``h.N.attn``, ``layers.N.attention``)
  does not matter;
- K and V head sizes must equal ``ModelInfo.head_dim`` (the paged cache's one head size),
  else the pass fails (e.g. multi-head latent attention); ALiBi (``baddbmm`` with a
  bias) and attention sinks (extra logit columns) do not match and fail the invariant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from .. import ops as _ops  # noqa: F401  (registers devin::paged_attention)
from ..capture import module_path_of
from ..graph_utils import RESHAPES, add_call, counted_nodes, is_call, node_delta, node_shape
from ..pipeline import Pass, PassContext, PassError, PassResult
from .dead_code import eliminate_dead_code

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
    return AttentionSite(node, q, k, v, node.kwargs.get("scale"), 0.0, "sdpa")


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


def _is_qk_matmul(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    if not is_call(x, aten.matmul.default):
        return None
    q, kt = x.args
    if is_call(kt, aten.transpose.int) and sorted(a % 4 for a in kt.args[1:3]) == [2, 3]:
        return q, kt.args[0]
    return None


def _match_eager(node: torch.fx.Node) -> AttentionSite | None:
    if not is_call(node, *_SOFTMAX) or node.args[1] not in (-1, 3):
        return None
    # Forward: softmax → [cast] → [dropout] → matmul(·, v)
    cur = node
    while True:
        nxt = _single_user(cur)
        if nxt is None:
            return None
        if is_call(nxt, *_CASTS):
            cur = nxt
            continue
        if is_call(nxt, *_DROPOUT):
            if nxt.args[1] and (len(nxt.args) < 3 or nxt.args[2]):
                raise PassError(f"{nxt.name}: attention dropout in training mode; call model.eval()")
            cur = nxt
            continue
        break
    if not (is_call(nxt, aten.matmul.default) and nxt.args[0] is cur):
        return None
    pv, v = nxt, nxt.args[1]
    # Backward: scores [+ mask] ← [softcap] ← [· scale] ← matmul(q, kᵀ)
    s = node.args[0]
    if is_call(s, aten.add.Tensor):
        a, b = s.args
        s = a if _looks_like_scores(a) else b if _looks_like_scores(b) else None
        if s is None:
            return None
    s, softcap = _peel_softcap(s)
    s, scale = _peel_scale(s)
    qk = _is_qk_matmul(s)
    if qk is None:
        return None
    q, k = qk
    return AttentionSite(pv, q, k, v, 1.0 if scale is None else scale, softcap, "eager")


def _looks_like_scores(x: object) -> bool:
    if not isinstance(x, torch.fx.Node):
        return False
    y, _ = _peel_softcap(x)
    y, _ = _peel_scale(y)
    return _is_qk_matmul(y) is not None


def _skip_full_slices(x: torch.fx.Node) -> torch.fx.Node:
    """``x[:, :, :]``-style slices (start 0, end past the end, step 1) are identities."""
    while is_call(x, aten.slice.Tensor):
        args = list(x.args) + [None] * (5 - len(x.args))
        start, end, step = args[2], args[3], args[4]
        if start not in (None, 0) or step not in (None, 1) or not (end is None or (isinstance(end, int) and end >= 2**62)):
            break
        x = x.args[0]
    return x


def _strip_repeat_kv(x: torch.fx.Node, num_kv_heads: int) -> torch.fx.Node:
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


class AttentionToPaged(Pass):
    name = "attention_to_paged"

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        info = ctx.info
        before = counted_nodes(gm)
        sites = find_attention_sites(gm)
        by_module: dict[str, AttentionSite] = {}
        for site in sites:
            path = (module_path_of(site.output, among=info.attention_modules)
                    or module_path_of(site.q, among=info.attention_modules))
            if path is None:
                raise PassError(f"attention node {site.output.name} ({site.form}) is not inside a decoder layer's "
                                "attention module; cannot assign it a KV-cache layer")
            if path in by_module:
                raise PassError(f"{path}: more than one attention pattern matched inside one module")
            by_module[path] = site
        expected = list(info.attention_modules)
        missing = [m for m in expected if m not in by_module]
        if missing or len(by_module) != info.num_layers:
            raise PassError(
                f"attention_to_paged rewrote {len(by_module)} of {info.num_layers} attention layers; "
                f"no SDPA or softmax(QKᵀ·scale+mask)·V pattern matched in: {missing or sorted(set(by_module) - set(expected))}"
            )
        graph = gm.graph
        for layer, path in enumerate(expected):
            site = by_module[path]
            k = _strip_repeat_kv(site.k, info.num_kv_heads)
            v = _strip_repeat_kv(site.v, info.num_kv_heads)
            for name, t in (("key", k), ("value", v)):
                shape = node_shape(t)
                if shape is not None and shape[1] != info.num_kv_heads:
                    raise PassError(f"{path}: {name} has {shape[1]} heads after undoing repeat_kv, expected "
                                    f"{info.num_kv_heads} KV heads (unrecognised GQA pattern)")
            dims = {name: (node_shape(t) or (None,))[-1] for name, t in (("key", k), ("value", v))}
            wrong = {name: d for name, d in dims.items() if d is not None and d != info.head_dim}
            if wrong:
                raise PassError(
                    f"{path}: {', '.join(f'{n} head_dim {d}' for n, d in wrong.items())} but the paged KV cache "
                    f"holds head_dim {info.head_dim} (config.head_dim) for both keys and values; attention whose "
                    "K/V head sizes differ from config.head_dim (e.g. multi-head latent attention) is unsupported"
                )
            head_dim = node_shape(site.q)[-1]
            scale = site.scale if site.scale is not None else 1.0 / math.sqrt(head_dim)
            window = int(info.sliding_windows.get(path, -1))
            with graph.inserting_before(site.output):
                flat = []
                for t in (site.q, k, v):
                    tt = add_call(graph, aten.transpose.int, (t, 1, 2), like=site.output)
                    flat.append(add_call(graph, aten.squeeze.dim, (tt, 0), like=site.output))
                out = add_call(graph, torch.ops.devin.paged_attention.default,
                               (*flat, layer, float(scale), float(site.softcap), window), like=site.output)
                out4 = add_call(graph, aten.unsqueeze.default, (out, 0), like=site.output)
                result = add_call(graph, aten.transpose.int, (out4, 1, 2), like=site.output)
            site.output.replace_all_uses_with(result)
        eliminate_dead_code(gm)
        return PassResult(matches=len(expected),
                          note=f"{len(expected)} layers; {node_delta(gm, before)} (mask subgraph dead)")
