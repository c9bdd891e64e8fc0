"""Attention mass per cached slot: what KV pruning scores tokens by.

For one sequence and one layer, ``attention_mass`` is ``[Hkv, L]``: the softmax weight the
step's queries put on each of the ``L`` cached slots, summed over the query tokens of the
step and over the ``G`` query heads that share a KV head (so each row sums to
``G · q_len``). The torch reference returns it as a side output of its attention; for
backends that cannot (CPU SDPA, FlashAttention), :func:`recompute_decode_mass` recomputes it
from ``q`` and the cache, and KV pruning calls it only on evaluation steps.
"""
from __future__ import annotations

import torch

from ..runtime.context import AttentionMetadata
from .kv_write import gather_sequence


def group_mass(probs: torch.Tensor) -> torch.Tensor:
    """probs [Hkv, G, q, L] → mass [Hkv, L] (summed over the group's heads and the queries)."""
    return probs.sum(dim=(1, 2))


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
        kk = gather_sequence(k_cache, meta.block_tables[b], L).float()  # [L, Hkv, D]
        qq = q[s].float().view(Hkv, G, D)
        scores = torch.einsum("hgd,lhd->hgl", qq, kk) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = torch.softmax(scores, dim=-1).sum(dim=1)
    return out
