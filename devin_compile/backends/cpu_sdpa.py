"""CPU fast path: PyTorch's fused CPU SDPA kernels on views of the paged cache.

- A sequence with no cached context (a fresh prefill) attends over its own new
  k/v directly with ``is_causal=True``: no gather at all.
- Pure decode steps gather every sequence's blocks in one ``index_select`` and run a
  single batched SDPA call with a key-padding mask.
- Anything else (chunked prefill over cached context, sliding windows) gathers that
  sequence's slots and runs SDPA with an explicit mask.
Soft-capped logits are declined (SDPA has no soft-cap) and go to the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..runtime.context import AttentionMetadata
from .kv_write import gather_sequence, write_kv
from .registry import register_backend
from .torch_reference import visible_mask


def _sdpa(q, k, v, *, scale, mask=None, causal=False):
    """q [Hq, Lq, D], k/v [Hkv, Lk, D] (or with a leading batch dim)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[-3] != k.shape[-3])


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    B = meta.num_seqs
    bs = k_cache.shape[1]
    max_len = meta.max_seq_len
    nblocks = (max_len + bs - 1) // bs
    table = meta.block_tables[:, :nblocks].long()
    kk = k_cache[table].reshape(B, nblocks * bs, *k_cache.shape[2:])[:, :max_len].transpose(1, 2)
    vv = v_cache[table].reshape(B, nblocks * bs, *v_cache.shape[2:])[:, :max_len].transpose(1, 2)
    qq = q.unsqueeze(2)  # [B, Hq, 1, D]
    mask = None
    if min(meta.seq_lens_host) != max_len:
        mask = (torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:, None]).view(B, 1, 1, max_len)
    return _sdpa(qq, kk.to(q.dtype), vv.to(q.dtype), scale=scale, mask=mask).squeeze(2)


class CpuSdpaBackend:
    name = "cpu_sdpa"
    priority = 10

    def is_available(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def supports(self, *, dtype, head_dim, softcap, sliding_window) -> bool:
        return softcap <= 0

    def forward(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window):
        write_kv(k, v, k_cache, v_cache, meta)
        if meta.is_pure_decode and sliding_window <= 0 and meta.num_seqs == q.shape[0]:
            return _decode(q, k_cache, v_cache, meta, scale)
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            end = start + q_len
            if q_len == 0:
                continue
            qq = q[start:end].transpose(0, 1)
            if kv_len == q_len and (sliding_window <= 0 or sliding_window >= kv_len):
                o = _sdpa(qq, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1), scale=scale,
                          causal=q_len > 1)
            else:
                kk = gather_sequence(k_cache, meta.block_tables[b], kv_len).transpose(0, 1).to(q.dtype)
                vv = gather_sequence(v_cache, meta.block_tables[b], kv_len).transpose(0, 1).to(q.dtype)
                mask = visible_mask(q_len, kv_len, sliding_window, q.device)
                o = _sdpa(qq, kk, vv, scale=scale, mask=mask)
            out[start:end] = o.transpose(0, 1)
            start = end
        return out


register_backend(CpuSdpaBackend())
