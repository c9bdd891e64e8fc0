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
- BLOOM's form is accepted too: ``baddbmm(bias, q3, kᵀ3, beta, alpha)`` over [B·H, T, D]
  reshapes of [1, H, T, D] tensors, ``bmm(view(p), v3)`` viewed back to 4-D; ``masked_fill``
  masks and casts between the scores and the softmax are walked through;
- every term added to the scores (``+ mask``, ``baddbmm``'s input, SDPA's float ``attn_mask``)
  is evaluated on a probe (``alibi_bias.py``): a mask is dropped, ALiBi becomes a per-head
  ``alibi_slopes`` buffer passed as the op's last argument, anything else is a ``PassError``;
- K and V head sizes must equal ``ModelInfo.head_dim`` (the paged cache's one head size),
  else the pass fails; models with multi-head latent attention (``ModelInfo.mla``) are
  rewritten to ``devin::mla_attention`` instead (``mla_rewrite.py``); attention sinks (extra
  logit columns) do not match and fail the invariant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx
from torch._guards import detect_fake_mode

from .. import ops as _ops  # noqa: F401  (registers devin::paged_attention)
from ..capture import module_path_of
from ..graph_utils import RESHAPES, add_call, counted_nodes, fake_value, is_call, node_delta, node_shape
from ..pipeline import Pass, PassContext, PassError, PassResult
from .alibi_bias import PROBE_LEN, SubgraphEvaluator, additive_bias, fit_alibi
from .attention_scores import as_4d, peel_scores
from .dead_code import eliminate_dead_code
from .mla_rewrite import drop_dead_copies, rewrite_mla_site

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
        if is_call(nxt, *RESHAPES):  # BLOOM: probs viewed to [B·H, T, T] for a bmm
            cur = nxt
            continue
        break
    if is_call(nxt, aten.matmul.default) and nxt.args[0] is cur:
        pv, v = nxt, nxt.args[1]
    elif is_call(nxt, aten.bmm.default) and nxt.args[0] is cur:
        # [H, T, Dv] = bmm(probs, v3): the site's output is its view back to [1, H, T, Dv]
        pv, v = _single_user(nxt), as_4d(nxt.args[1])
        if pv is None or v is None or as_4d(pv) is not pv or not is_call(pv, *RESHAPES):
            return None
    else:
        return None
    # Backward: scores [+ mask/bias] ← [softcap] ← [· scale] ← matmul(q, kᵀ) | baddbmm(bias, q, kᵀ)
    peeled = peel_scores(node.args[0])
    if peeled is None:
        return None
    q, k, scale, softcap, terms = peeled
    return AttentionSite(pv, q, k, v, 1.0 if scale is None else scale, softcap, "eager", terms)


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
        evaluator = SubgraphEvaluator(gm, min(PROBE_LEN, max(2, info.max_model_len)), info.device)
        alibi_layers = 0
        mla_copies: list = []
        for layer, path in enumerate(expected):
            site = by_module[path]
            slopes = None
            if site.bias_terms:
                try:
                    bias = additive_bias(evaluator, [(n, c, info.num_heads) for n, c in site.bias_terms])
                except PassError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise PassError(f"{path}: could not evaluate the terms added to the attention scores on a "
                                    f"probe ({type(e).__name__}: {e}); cannot tell a mask from a position bias") from e
                slopes = fit_alibi(bias, info.num_heads, path) if bias is not None else None
            k = _strip_repeat_kv(site.k, info.num_kv_heads)
            v = _strip_repeat_kv(site.v, info.num_kv_heads)
            if info.mla is not None:  # multi-head latent attention: the cache holds latents (mla_rewrite.py)
                if slopes is not None or site.softcap:
                    raise PassError(f"{path}: multi-head latent attention with ALiBi or a soft-cap is unsupported")
                site.k, site.v = k, v
                head_dim = node_shape(site.q)[-1]
                scale = site.scale if site.scale is not None else 1.0 / math.sqrt(head_dim)
                mla_copies += rewrite_mla_site(gm, site, layer, scale, info, path)
                continue
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
                args = (*flat, layer, float(scale), float(site.softcap), window)
                if slopes is not None:  # ALiBi: per-head slopes, a constant of the graph
                    gm.register_buffer(f"alibi_slopes_{layer}", slopes.to(info.device))
                    attr = graph.get_attr(f"alibi_slopes_{layer}")
                    mode = detect_fake_mode([fake_value(site.q)])
                    attr.meta["val"] = mode.from_tensor(gm.get_buffer(f"alibi_slopes_{layer}")) if mode else None
                    args = (*args, attr)
                    alibi_layers += 1
                out = add_call(graph, torch.ops.devin.paged_attention.default, args, like=site.output)
                out4 = add_call(graph, aten.unsqueeze.default, (out, 0), like=site.output)
                result = add_call(graph, aten.transpose.int, (out4, 1, 2), like=site.output)
            site.output.replace_all_uses_with(result)
        eliminate_dead_code(gm)
        if mla_copies:  # the expanded keys' in-place fills: dead now, but DCE keeps in-place ops
            drop_dead_copies(gm, mla_copies)
            eliminate_dead_code(gm)
        alibi = f", ALiBi slopes on {alibi_layers}" if alibi_layers else ""
        alibi += ", multi-head latent attention (latent KV cache)" if info.mla is not None else ""
        return PassResult(matches=len(expected),
                          note=f"{len(expected)} layers{alibi}; {node_delta(gm, before)} (mask/bias subgraph dead)")
