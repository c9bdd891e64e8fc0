"""Multi-head latent attention (DeepSeek-V2/V3) over a paged *latent* cache, in torch.

The cache holds, per token and layer, one row ``[c | k_rope]`` of ``R + dr`` values: the
compressed KV latent ``c`` (``kv_lora_rank`` R, after ``kv_a_layernorm``) and the shared rotary
key ``k_rope`` (dr, after rotary). The model's ``kv_b_proj`` weight W [H·(dn+dv), R] expands
a latent into per-head keys and values: ``k_nope_h = W_k[h] c`` (W_k[h]: [dn, R]) and
``v_h = W_v[h] c`` (W_v[h]: [dv, R]). A query head h scores key j as
``scale · (q_nope_h · k_nope_h,j + q_rope_h · k_rope_j)``.

Two exact evaluations of the same sum (they differ only by float rounding):

- :func:`expanded_attention` (prefill rows, and the oracle): expand each sequence's cached
  latents into K/V, then plain attention, as the HF model does;
- :func:`absorbed_decode` (decode rows): absorb W_k into the query
  (``q̃_h = W_k[h]ᵀ q_nope_h``, [R]) and W_v into the output (``o_h = W_v[h] Σ_j p_hj c_j``), so
  each step reads R + dr values per cached token and never expands K/V: DeepSeek-V2 §2.1.2's
  "absorbed" inference. All decode rows of a step run as one batch over length-padded latents.
"""
from __future__ import annotations

import torch

from ...step import AttentionMetadata
from .kv_write import gather_sequence
from .torch_reference import visible_mask


def split_kv_b(w_kv_b: torch.Tensor, num_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H·(dn+dv), R] → (W_k [H, dn, R], W_v [H, dv, R]) as views."""
    w = w_kv_b.view(num_heads, -1, w_kv_b.shape[-1])
    return w[:, :nope_dim], w[:, nope_dim:]


def write_latent(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rows ``[latent | k_rope]`` ([T, R] and [T, dr]) into cache [blocks, bs, 1, R+dr]; slots < 0 skipped."""
    keep = slot_mapping >= 0
    flat = cache.view(-1, cache.shape[-1])
    rows = torch.cat([latent, k_rope], dim=-1).to(cache.dtype)
    if bool(keep.all()):
        flat.index_copy_(0, slot_mapping, rows)
    else:
        flat.index_copy_(0, slot_mapping[keep], rows[keep])


def expanded_attention(q_nope, q_rope, cache, meta: AttentionMetadata, w_kv_b, scale: float,
                       rows: list[int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the tokens of sequences ``rows`` (default: all) with K/V expanded from the
    latents (float32); writes their rows of ``out`` ([T, H, dv], created when None)."""
    T, H, dn = q_nope.shape
    R = w_kv_b.shape[-1]
    w_k, w_v = split_kv_b(w_kv_b.float(), H, dn)
    if out is None:
        out = q_nope.new_zeros((T, H, w_v.shape[1]))
    starts = meta.query_start_loc.tolist()
    for b in range(meta.num_seqs) if rows is None else rows:
        s, e = starts[b], starts[b + 1]
        kv_len = meta.seq_lens_host[b]
        if e == s or kv_len == 0:
            continue
        lat = gather_sequence(cache, meta.block_tables[b], kv_len)[:, 0].float()  # [L, R+dr]
        c, k_rope = lat[:, :R], lat[:, R:]
        k_nope = torch.einsum("hdr,lr->hld", w_k, c)
        v = torch.einsum("hdr,lr->hld", w_v, c)
        scores = (torch.einsum("qhd,hld->hql", q_nope[s:e].float(), k_nope)
                  + torch.einsum("qhd,ld->hql", q_rope[s:e].float(), k_rope)) * scale
        scores = scores.masked_fill(~visible_mask(e - s, kv_len, -1, q_nope.device), float("-inf"))
        o = torch.einsum("hql,hld->qhd", torch.softmax(scores, dim=-1), v)
        out[s:e] = o.to(out.dtype)
    return out


def absorbed_decode(q_nope, q_rope, cache, meta: AttentionMetadata, w_kv_b, scale: float, rows: list[int],
                    out: torch.Tensor) -> torch.Tensor:
    """One query per sequence in ``rows``: scores and values on the latents, batched over the rows."""
    H, dn = q_nope.shape[1], q_nope.shape[2]
    R = w_kv_b.shape[-1]
    w_k, w_v = split_kv_b(w_kv_b.float(), H, dn)
    starts = meta.query_start_loc.tolist()
    lens = [meta.seq_lens_host[b] for b in rows]
    L = max(max(lens), 1)
    bs = cache.shape[1]
    nblk = (L + bs - 1) // bs
    table = torch.tensor([(meta.block_tables_host[b] + [0] * nblk)[:nblk] for b in rows], dtype=torch.long,
                         device=cache.device)
    pos = torch.arange(L, device=cache.device)
    slots = table[:, pos // bs] * bs + pos % bs  # [B, L]
    lat = cache.view(-1, cache.shape[-1]).index_select(0, slots.flatten()).float().view(len(rows), L, -1)
    c, k_rope = lat[..., :R], lat[..., R:]
    tok = torch.tensor([starts[b] for b in rows], dtype=torch.long, device=q_nope.device)
    qn, qr = q_nope.index_select(0, tok).float(), q_rope.index_select(0, tok).float()  # [B, H, ·]
    q_lat = torch.einsum("bhd,hdr->bhr", qn, w_k)  # W_k absorbed into the query
    scores = (torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(qr, k_rope.transpose(1, 2))) * scale  # [B, H, L]
    valid = pos[None, :] < torch.tensor(lens, device=cache.device)[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    o_lat = torch.bmm(torch.softmax(scores, dim=-1), c)  # [B, H, R]
    o = torch.einsum("bhr,hdr->bhd", o_lat, w_v)  # W_v absorbed into the output
    out.index_copy_(0, tok, o.to(out.dtype))
    return out


def mla_forward(q_nope, q_rope, latent, k_rope, cache, meta: AttentionMetadata, w_kv_b, scale: float,
                *, absorb: bool = True) -> torch.Tensor:
    """Write this step's latents, then attend: decode rows absorbed (``absorb``), the rest expanded."""
    write_latent(latent, k_rope, cache, meta.slot_mapping)
    T, H, dn = q_nope.shape
    out = q_nope.new_zeros((T, H, w_kv_b.shape[0] // H - dn))
    decode = [b for b, n in enumerate(meta.query_lens_host) if n == 1 and meta.seq_lens_host[b] > 0] if absorb else []
    if decode:
        absorbed_decode(q_nope, q_rope, cache, meta, w_kv_b, scale, decode, out)
    rest = [b for b in range(meta.num_seqs) if b not in set(decode)]
    if rest:
        expanded_attention(q_nope, q_rope, cache, meta, w_kv_b, scale, rest, out)
    return out
