"""attention_to_paged's multi-head latent attention (DeepSeek-V2/V3) rewrite: one site → ``devin::mla_attention``.

Pattern (HF's DeepSeek attention as captured; the core is the SDPA or eager site
attention_to_paged already matched)::

    kv   = linear(c, W_kv_b)                     # c: [1, 1, T, R] latent (after kv_a_layernorm)
    k_nope, v = split(transpose(view(kv, [1, T, H, dn+dv]), 1, 2), [dn, dv], -1)
    k    = new_empty(...); k[..., :dn] ← k_nope; k[..., dn:] ← expand(k_rope, H)   # V3 (copy_)
         | cat([k_nope, expand(k_rope, H)], -1)                                     # V2
    q    = cat([q_nope, q_rope], -1)
    attention(q, k, v)                           # [1, H, T, dv]

Replacement (the expansion and its in-place copies become dead and are removed)::

    transpose(unsqueeze(mla_attention(q_nope', q_rope', c', k_rope', W_kv_b, layer, scale), 0), 1, 2)
    where x' = squeeze(transpose(x, 1, 2), 0)   (q parts: [T, H, ·]),  c' = c.reshape(-1, R),
          k_rope' = k_rope.reshape(-1, dr)

so the paged cache stores ``R + dr`` values per token and layer (``ModelInfo.kv_cache_layout``)
instead of ``H·(dn+dr+dv)``. Invariant: every attention layer of an MLA model (``ModelInfo.mla``)
matches; otherwise :class:`PassError` names the layer and the piece that did not match.
"""
from __future__ import annotations

import torch
import torch.fx

from ...graph_utils import RESHAPES, add_call, is_call, node_shape
from ...pipeline import PassError
from .sites import AttentionSite, batched_heads, flat_heads

aten = torch.ops.aten
_GETITEM = __import__("operator").getitem


def _split_part(x: object, index: int) -> tuple[torch.fx.Node, list[int]] | None:
    """getitem(split_with_sizes(base, sizes, -1), index) → (base, sizes)."""
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is _GETITEM
            and x.args[1] == index and is_call(x.args[0], aten.split_with_sizes.default)):
        return None
    split = x.args[0]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, 3):
        return None
    return split.args[0], list(split.args[1])


def _kv_b(v: object) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, int, int] | None:
    """v = split(transpose(view(linear(c, W))))[1] → (c, W, split base, dn, dv)."""
    part = _split_part(v, 1)
    if part is None or len(part[1]) != 2:
        return None
    base, (dn, dv) = part
    x = base
    if is_call(x, aten.transpose.int):
        x = x.args[0]
    while is_call(x, *RESHAPES):
        x = x.args[0]
    if not is_call(x, aten.linear.default) or (len(x.args) > 2 and x.args[2] is not None):
        return None
    c, w = x.args[:2]
    if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
        return None
    return c, w, base, dn, dv


def _strip_expand(x: object) -> object:
    while is_call(x, aten.expand.default):
        x = x.args[0]
    return x


def _k_rope(k: object, dn: int) -> tuple[object, list[torch.fx.Node]]:
    """The rotary key [1, 1, T, dr] inside the expanded key, and the in-place copies to drop."""
    if is_call(k, aten.cat.default) and len(k.args[0]) == 2:
        return _strip_expand(k.args[0][1]), []
    if is_call(k, aten.new_empty.default, aten.empty.memory_format, aten.zeros.default):
        rope, copies = None, []
        for s in k.users:
            if not is_call(s, aten.slice.Tensor):
                continue
            for c in s.users:
                if is_call(c, aten.copy_.default) and c.args[0] is s:
                    copies.append(c)
                    if len(s.args) > 2 and s.args[2] == dn:
                        rope = _strip_expand(c.args[1])
        return rope, copies
    return None, []


def build_mla_attention(graph: torch.fx.Graph, site: AttentionSite, k: torch.fx.Node, v: torch.fx.Node, layer: int,
                        scale: float, info, path: str) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Insert one MLA site's ``devin::mla_attention`` (at the graph's insertion point), over the
    un-repeated key ``k`` and value ``v``; returns the node replacing ``site.output`` and the
    in-place copy nodes to erase once dead."""
    R, dr = info.mla
    found = _kv_b(v)
    if found is None:
        raise PassError(f"{path}: multi-head latent attention, but the value is not split from "
                        "linear(latent, kv_b_proj.weight) as in DeepSeek's expand_kv")
    c, w, kv_base, dn, dv = found
    if (node_shape(c) or (None,))[-1] != R:
        raise PassError(f"{path}: kv_b_proj's input has width {(node_shape(c) or ('?',))[-1]}, expected "
                        f"kv_lora_rank {R}")
    k_rope, copies = _k_rope(k, dn)
    nope = [cp.args[1] for cp in copies if cp.args[1] is not None]
    if k_rope is None or (node_shape(k_rope) or (None,))[-1] != dr or (node_shape(k_rope) or (0, 0))[1] != 1:
        raise PassError(f"{path}: could not find the shared rotary key (width {dr}, one head) in the expanded key")
    if copies and not any(_split_part(n, 0) is not None and _split_part(n, 0)[0] is kv_base for n in nope):
        raise PassError(f"{path}: the expanded key's no-position part is not kv_b_proj's k_nope")
    q = site.q
    if not (is_call(q, aten.cat.default) and len(q.args[0]) == 2 and q.args[1] in (-1, 3)):
        raise PassError(f"{path}: the query is not cat([q_nope, q_rope], -1)")
    q_nope, q_rope = q.args[0]
    if (node_shape(q_nope) or (None,))[-1] != dn or (node_shape(q_rope) or (None,))[-1] != dr:
        raise PassError(f"{path}: query parts of widths {node_shape(q_nope)}, {node_shape(q_rope)}; "
                        f"expected qk_nope_head_dim {dn} and qk_rope_head_dim {dr}")
    like = site.output
    qn = flat_heads(graph, q_nope, like)
    qr = flat_heads(graph, q_rope, like)
    lat = add_call(graph, aten.reshape.default, (c, [-1, R]), like=like)
    kr = add_call(graph, aten.reshape.default, (k_rope, [-1, dr]), like=like)
    out = add_call(graph, torch.ops.devin.mla_attention.default, (qn, qr, lat, kr, w, layer, float(scale)), like=like)
    return batched_heads(graph, out, like), copies


def drop_dead_copies(gm: torch.fx.GraphModule, copies: list[torch.fx.Node]) -> None:
    """Erase ``copy_`` into slices of a buffer nothing reads any more (DCE keeps in-place ops)."""
    for cp in copies:
        sl = cp.args[0]
        buf = sl.args[0]
        readers = [u for s in buf.users for u in ([s] if not is_call(s, aten.slice.Tensor) else
                                                   [x for x in s.users if not is_call(x, aten.copy_.default)])]
        if readers:
            continue
        gm.graph.erase_node(cp)
        if not sl.users:
            gm.graph.erase_node(sl)
