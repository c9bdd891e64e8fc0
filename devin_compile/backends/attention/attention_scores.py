"""Attention mass per cached slot: what KV pruning scores tokens by.

For one sequence and one layer, ``attention_mass`` is ``[Hkv, L]``: the softmax weight the
step's queries put on each of the ``L`` cached slots, summed over the query tokens of the
step and over the ``G`` query heads that share a KV head (so each row sums to
``G · q_len``). The torch reference returns it as a side output of its attention; for
backends that cannot (FlashAttention), :func:`recompute_decode_mass` recomputes it from ``q``
and the cache, and KV pruning calls it only on evaluation steps. (CPU SDPA gives it as a side
output of its C decode kernel.)
"""
from __future__ import annotations

import torch

from ...step import AttentionMetadata
from .kv_write import gather_sequence


def group_mass(probs: torch.Tensor) -> torch.Tensor:
    """probs [Hkv, G, q, L] → mass [Hkv, L] (summed over the group's heads and the queries)."""
    return probs.sum(dim=(1, 2))


def _keys(k_cache: torch.Tensor, meta: AttentionMetadata, b: int, L: int) -> torch.Tensor:
    """Row b's first L keys [L, Hkv, D]: a view when its blocks are consecutive (memoised per step), else a gather."""
    key = ("kv_prune_range", b)
    start = meta.scratch.get(key)
    if start is None:
        bs = k_cache.shape[1]
        blocks = meta.block_tables_host[b][:(L + bs - 1) // bs]
        start = blocks[0] * bs if all(y - x == 1 for x, y in zip(blocks, blocks[1:])) else -1
        meta.scratch[key] = start
    if start >= 0:
        return k_cache.view(-1, *k_cache.shape[2:])[start:start + L]
    return gather_sequence(k_cache, meta.block_tables[b], L)


def recompute_decode_mass(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, rows, *,
                          scale: float, softcap: float = 0.0) -> dict[int, torch.Tensor]:
    """Attention mass [Hkv, seq_len] of decode row ``b`` (one query) for each ``b`` in ``rows``.

    q: [T, Hq, D] with sequence b's query at ``query_start_loc[b]``; the cache already holds
    this step's keys. Same math as the torch reference (float32, causal by slot).
    """
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    starts = meta.query_start_loc.tolist() if len(rows) > 1 else None
    out: dict[int, torch.Tensor] = {}
    for b in rows:
        L = meta.seq_lens_host[b]
        s = starts[b] if starts is not None else int(meta.query_start_loc[b])
        kk = _keys(k_cache, meta, b, L)  # [L, Hkv, D]
        qq = q[s].float().view(Hkv, G, D)
        scores = torch.bmm(qq, kk.permute(1, 2, 0).float()) * scale  # [Hkv, G, L]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = torch.softmax(scores, dim=-1).sum(dim=1)
    return out


def window_scores(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, b: int, window: int, *,
                  scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapKV-style observation window: the last ``window`` queries of row ``b``'s chunk score every slot.

    Returns (summed normalised scores [L], observations [L]): for each query, the per-KV-head
    mean attention (group mass / G), max over KV heads, times the slots that query sees (so
    1.0 = uniform); summed over the window's queries, with the number of queries that saw each slot.
    """
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    L = meta.seq_lens_host[b]
    e = int(meta.query_start_loc[b + 1])
    s = max(int(meta.query_start_loc[b]), e - window)
    w = e - s
    kk = gather_sequence(k_cache, meta.block_tables[b], L).float()  # [L, Hkv, D]
    qq = q[s:e].float().view(w, Hkv, G, D)
    scores = torch.einsum("qhgd,lhd->hgql", qq, kk) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(L - w, L, device=q.device)
    visible = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]  # [w, L]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    norm = (probs.sum(dim=1) / G).amax(dim=0) * (qpos + 1)[:, None].float()  # [w, L]
    return norm.sum(dim=0), visible.sum(dim=0).float()
