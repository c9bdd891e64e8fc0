"""Torch reference attention over the paged cache: plain math in float32, any device.

It is the oracle every faster backend is tested against, and it serves every call
(GQA, soft-capping, sliding windows, chunked attention, ALiBi, attention sinks, mixed
prefill/decode batches).
"""
from __future__ import annotations

import torch

from ...step import AttentionMetadata
from .attention_scores import group_mass
from .kv_write import gather_sequence, write_kv
from .registry import register_backend


def visible_mask(q_len: int, kv_len: int, sliding_window: int, device: torch.device,
                 attention_chunk: int = -1) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (the (kv_len - q_len + i)-th slot) sees slot j: causal, within the
    window (``j > p - W``) and within its own chunk (``j >= floor(p / C)·C``) when those are given."""
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kpos = torch.arange(kv_len, device=device)[None, :]
    mask = kpos <= qpos
    if sliding_window > 0:
        mask &= kpos > qpos - sliding_window
    if attention_chunk > 0:
        mask &= kpos >= torch.div(qpos, attention_chunk, rounding_mode="floor") * attention_chunk
    return mask


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` [Hq-like..., q, k]; with ``sinks`` (one logit per head,
    broadcast as [..., 1, 1]) each row's denominator also holds ``exp(sink)``, a column that attends to
    nothing and is dropped after the softmax (rows then sum to less than 1)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    col = sinks.float().to(scores.device).view(*scores.shape[:-2], 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]


def alibi_bias(slopes: torch.Tensor, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[Hq, q_len, kv_len] float32: ``slope_h · (j − p_i)`` for query i at slot p_i = kv_len − q_len + i."""
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kpos = torch.arange(kv_len, device=device)[None, :]
    return slopes.float().to(device)[:, None, None] * (kpos - qpos).float()


def reference_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    *, scale: float, softcap: float = 0.0, sliding_window: int = -1, mass_out: dict | None = None,
    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None, attention_chunk: int = -1,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over each sequence's cached tokens (already written).

    With ``mass_out`` (a dict pre-filled with the batch rows wanted), also stores each such
    row's attention mass [Hkv, kv_len] (summed over its queries and each KV head's query
    group; see backends/attention/attention_scores.py) under its row index.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    Dv = v_cache.shape[-1]
    out = q.new_zeros((T, Hq, Dv))
    starts = meta.query_start_loc.tolist()
    for b, kv_len in enumerate(meta.seq_lens_host):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0 or kv_len == 0:
            continue
        kk = gather_sequence(k_cache, meta.block_tables[b], kv_len).float()  # [L, Hkv, D]
        vv = gather_sequence(v_cache, meta.block_tables[b], kv_len).float()
        qq = q[s:e].float().reshape(q_len, Hkv, G, D)
        scores = torch.einsum("qhgd,khd->hgqk", qq, kk) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if alibi_slopes is not None:  # after the soft-cap, as the bias is added to the capped scores
            scores = scores + alibi_bias(alibi_slopes, q_len, kv_len, q.device).view(Hkv, G, q_len, kv_len)
        mask = visible_mask(q_len, kv_len, sliding_window, q.device, attention_chunk)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = softmax_with_sinks(scores, sinks)
        if mass_out is not None and b in mass_out:
            mass_out[b] = group_mass(probs)
        o = torch.einsum("hgqk,khd->qhgd", probs, vv).reshape(q_len, Hq, Dv)
        out[s:e] = o.to(q.dtype)
    return out


class TorchReferenceBackend:
    name = "torch_reference"
    priority = 0

    def is_available(self, device: torch.device) -> bool:
        return True

    def supports(self, **_: object) -> bool:
        return True

    def forward(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, alibi_slopes=None,
                sinks=None, attention_chunk=-1):
        write_kv(k, v, k_cache, v_cache, meta)
        return reference_paged_attention(q, k_cache, v_cache, meta, scale=scale, softcap=softcap,
                                         sliding_window=sliding_window, alibi_slopes=alibi_slopes, sinks=sinks,
                                         attention_chunk=attention_chunk)

    def forward_with_scores(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, rows):
        """:meth:`forward` plus the attention mass of batch ``rows`` ({row: [Hkv, kv_len]})."""
        write_kv(k, v, k_cache, v_cache, meta)
        mass = dict.fromkeys(rows)
        out = reference_paged_attention(q, k_cache, v_cache, meta, scale=scale, softcap=softcap,
                                        sliding_window=sliding_window, mass_out=mass)
        return out, {b: m for b, m in mass.items() if m is not None}


register_backend(TorchReferenceBackend())
