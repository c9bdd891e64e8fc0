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
- the scale may be ``mul``/``div`` by a constant, also in place (Falcon's ``scores /= √d``), on the
  scores or on q or kᵀ right at the product (``scores.py``); a query scaled before its views
  (XGLM) stays scaled and the op gets scale 1;
- the products may be ``matmul``, head-first 4-D ``einsum`` or ``bmm`` over [B·H, T, D] views;
  masks may be added, ``masked_fill``ed, ``where``-filled or clamped with ``max(s, finfo.min)``;
- the key may be broadcast rather than repeated (multi-query ``q @ kᵀ`` with one KV head);
- each site is assigned to its layer through ``ModelInfo.attention_modules`` (the
  innermost enclosing attention module), so layer naming (``h.N.attn``, ``layers.N.attention``)
  does not matter;
- BLOOM's form is accepted too: ``baddbmm(bias, q3, kᵀ3, beta, alpha)`` over [B·H, T, D]
  reshapes of [1, H, T, D] tensors, ``bmm(view(p), v3)`` viewed back to 4-D; ``masked_fill``
  masks and casts between the scores and the softmax are walked through;
- every term added to the scores (``+ mask``, ``baddbmm``'s input, SDPA's float ``attn_mask``)
  is evaluated on a probe (``alibi.py``): a mask is dropped, ALiBi becomes a per-head
  ``alibi_slopes`` buffer passed as the op's eighth argument, anything else is a ``PassError``;
- attention sinks (gpt-oss: ``softmax(cat([scores, sink], -1) − rowmax)[..., :-1]``, ``sinks.py``):
  the extra column is read on the same probe and becomes a per-head ``sinks=`` buffer;
- a layer whose mask is chunked (``ModelInfo.attention_chunks``, Llama 4's local layers) gets
  ``attention_chunk=C``;
- positions an attention module computes as ``arange`` over the step's tokens (right only without
  a cache, on one sequence: Llama 4's attention temperature tuning) read ``position_ids`` instead
  (``positions.py``);
- K and V head sizes must equal ``ModelInfo.head_dim`` (the paged cache's one head size),
  else the pass fails; models with multi-head latent attention (``ModelInfo.mla``) are
  rewritten to ``devin::mla_attention`` instead (``mla.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from ... import ops as _ops  # noqa: F401  (registers devin::paged_attention)
from ...capture import ModelInfo, module_path_of
from ...graph_utils import add_call, add_constant, eliminate_dead_code, fake_like, node_shape, replace_matches
from ...pipeline import Pass, PassContext, PassError, PassResult
from .alibi import PROBE_LEN, SubgraphEvaluator, additive_bias, fit_alibi
from .mla import build_mla_attention, drop_dead_copies
from .positions import arange_positions
from .sinks import fit_sinks
from .sites import AttentionSite, batched_heads, find_attention_sites, flat_heads, strip_repeat_kv


@dataclass
class _Layer:
    """One attention layer's site, ready to rewrite: un-repeated k and v, scale, ALiBi slopes, sinks."""

    index: int
    path: str
    site: AttentionSite
    k: torch.fx.Node
    v: torch.fx.Node
    scale: float
    slopes: torch.Tensor | None
    sinks: torch.Tensor | None = None


class AttentionToPaged(Pass):
    name = "attention_to_paged"

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        info = ctx.info
        evaluator = SubgraphEvaluator(gm, min(PROBE_LEN, max(2, info.max_model_len)), info.device)
        layers = [_prepare(evaluator, info, i, path, site) for i, (path, site) in enumerate(_sites_by_layer(gm, info))]
        copies: list[torch.fx.Node] = []  # MLA: the expanded keys' in-place fills

        def build(graph: torch.fx.Graph, old: torch.fx.Node, layer: _Layer) -> torch.fx.Node:
            if info.mla is None:
                return _paged_attention(gm, layer, info)
            out, fills = build_mla_attention(graph, layer.site, layer.k, layer.v, layer.index, layer.scale, info,
                                             layer.path)
            copies.extend(fills)
            return out

        done = replace_matches(gm, ((layer.site.output, layer) for layer in layers), build)
        if copies:  # dead now, but DCE keeps in-place ops
            drop_dead_copies(gm, copies)
            eliminate_dead_code(gm)
        moved = arange_positions(gm, info.attention_modules)  # after DCE: the masks' aranges are gone
        positions = f", positions from position_ids in {len(set(moved))}" if moved else ""
        return PassResult(matches=len(layers),
                          note=f"{len(layers)} layers{_terms_note(layers, info)}{positions}; {done.delta(gm)} "
                               "(mask/bias subgraph dead)")


def _terms_note(layers: list[_Layer], info: ModelInfo) -> str:
    """What the report says about per-head terms and chunks: ", ALiBi slopes on 2, sinks on 2", ..."""
    counts = (("ALiBi slopes", sum(layer.slopes is not None for layer in layers)),
              ("attention sinks", sum(layer.sinks is not None for layer in layers)),
              ("chunked attention", sum(info.attention_chunks.get(layer.path, -1) > 0 for layer in layers)))
    note = "".join(f", {what} on {n}" for what, n in counts if n)
    return note + (", multi-head latent attention (latent KV cache)" if info.mla is not None else "")


def _sites_by_layer(gm: torch.fx.GraphModule, info: ModelInfo) -> list[tuple[str, AttentionSite]]:
    """(attention module path, its site) in layer order; a ``PassError`` unless every layer has one."""
    by_module: dict[str, AttentionSite] = {}
    for site in find_attention_sites(gm):
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
            f"attention_to_paged rewrote {len(by_module)} of {info.num_layers} attention layers; no SDPA or "
            f"softmax(QKᵀ·scale+mask)·V pattern matched in: {missing or sorted(set(by_module) - set(expected))}"
        )
    return [(path, by_module[path]) for path in expected]


def _prepare(evaluator: SubgraphEvaluator, info: ModelInfo, index: int, path: str, site: AttentionSite) -> _Layer:
    """Classify the site's score terms (mask or ALiBi) and sinks, undo repeat_kv and check the heads."""
    slopes = _alibi_slopes(evaluator, info, path, site)
    sinks = fit_sinks(evaluator, site.sink, info.num_heads, path) if site.sink is not None else None
    k = strip_repeat_kv(site.k, info.num_kv_heads)
    v = strip_repeat_kv(site.v, info.num_kv_heads)
    if info.mla is not None:  # multi-head latent attention: the cache holds latents (mla.py)
        if slopes is not None or sinks is not None or site.softcap or info.attention_chunks.get(path, -1) > 0:
            raise PassError(f"{path}: multi-head latent attention with ALiBi, attention sinks, chunked attention "
                            "or a soft-cap is unsupported")
    else:
        _check_kv_heads(info, path, k, v)
    head_dim = node_shape(site.q)[-1]
    scale = site.scale if site.scale is not None else 1.0 / math.sqrt(head_dim)
    return _Layer(index, path, site, k, v, scale, slopes, sinks)


def _alibi_slopes(evaluator: SubgraphEvaluator, info: ModelInfo, path: str, site: AttentionSite) -> torch.Tensor | None:
    """The per-head ALiBi slopes the terms added to the scores amount to; None for masks (or no terms)."""
    if not site.bias_terms:
        return None
    try:
        bias = additive_bias(evaluator, [(n, c, info.num_heads) for n, c in site.bias_terms])
    except PassError:
        raise
    except Exception as e:  # noqa: BLE001
        raise PassError(f"{path}: could not evaluate the terms added to the attention scores on a "
                        f"probe ({type(e).__name__}: {e}); cannot tell a mask from a position bias") from e
    return fit_alibi(bias, info.num_heads, path) if bias is not None else None


def _check_kv_heads(info: ModelInfo, path: str, k: torch.fx.Node, v: torch.fx.Node) -> None:
    """The un-repeated k and v have the paged cache's KV heads and head size."""
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


def _paged_attention(gm: torch.fx.GraphModule, layer: _Layer, info: ModelInfo) -> torch.fx.Node:
    """``devin::paged_attention`` over the layer's [T, H, D] q, k, v (at the graph's insertion point),
    viewed back to attention's [1, H, T, D]."""
    graph, site = gm.graph, layer.site
    flat = [flat_heads(graph, t, site.output) for t in (site.q, layer.k, layer.v)]
    window = int(info.sliding_windows.get(layer.path, -1))
    args = (*flat, layer.index, float(layer.scale), float(site.softcap), window)
    if layer.slopes is not None:  # ALiBi: per-head slopes, a constant of the graph
        args = (*args, _head_constant(gm, f"alibi_slopes_{layer.index}", layer.slopes, site.q, info))
    kwargs = {}
    if layer.sinks is not None:  # attention sinks: one logit per head, a constant of the graph
        kwargs["sinks"] = _head_constant(gm, f"attention_sinks_{layer.index}", layer.sinks, site.q, info)
    chunk = int(info.attention_chunks.get(layer.path, -1))
    if chunk > 0:
        kwargs["attention_chunk"] = chunk
    out = add_call(graph, torch.ops.devin.paged_attention.default, args, kwargs, like=site.output)
    return batched_heads(graph, out, site.output)


def _head_constant(gm: torch.fx.GraphModule, name: str, values: torch.Tensor, like: torch.fx.Node,
                   info: ModelInfo) -> torch.fx.Node:
    """A per-head float32 vector as a persistent graph buffer (a ``get_attr`` node)."""
    values = values.to(info.device)
    return add_constant(gm, name, values, fake_like(like, values), persistent=True)


__all__ = ["AttentionSite", "AttentionToPaged", "find_attention_sites"]
