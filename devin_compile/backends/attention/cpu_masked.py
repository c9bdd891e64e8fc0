"""cpu_sdpa's path for per-head score terms: ALiBi biases and attention sinks, one SDPA call per sequence.

Each sequence attends in one float32 ``scaled_dot_product_attention`` call whose float mask carries
what the fused kernels cannot take as arguments:

- ALiBi: ``slope_h · (j − p_i)`` on every visible slot j of query i (at slot p_i);
- hidden slots (causal, window, chunk): ``-inf``;
- attention sinks: one extra key of zeros with a value of zeros is appended, and its mask column
  holds ``sink_h``. Its score is then ``0·scale + sink_h`` and its value adds nothing, so the
  softmax's denominator gains ``exp(sink_h)`` exactly as gpt-oss's extra logit column does.

The C decode kernel has neither term, so cpu_sdpa sends every such call (decode rows included) here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...step import AttentionMetadata
from .kv_write import gather_sequence
from .torch_reference import alibi_bias, visible_mask


def _mask(q_len: int, kv_len: int, Hq: int, device: torch.device, *, sliding_window: int, attention_chunk: int,
          slopes: torch.Tensor | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """[Hq or 1, q_len, kv_len (+1 with sinks)] float32 additive mask (see the module docstring)."""
    if slopes is not None:
        bias = alibi_bias(slopes, q_len, kv_len, device)
    else:
        bias = torch.zeros((1, q_len, kv_len), dtype=torch.float32, device=device)
    visible = visible_mask(q_len, kv_len, sliding_window, device, attention_chunk)
    bias = bias.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        col = sinks.float().to(device).view(Hq, 1, 1).expand(Hq, q_len, 1)
        bias = torch.cat([bias.expand(Hq, q_len, kv_len), col], dim=-1)
    return bias


def forward_masked(q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale: float, sliding_window: int,
                   attention_chunk: int = -1, slopes: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over each sequence's cached slots (this step's k/v already written),
    with the ALiBi ``slopes`` and/or ``sinks`` [Hq]; [T, Hq, Dv] in q's dtype."""
    Hq = q.shape[1]
    out = q.new_empty((q.shape[0], Hq, v.shape[-1]))
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        end = start + q_len
        if q_len == 0:
            continue
        if kv_len == q_len:  # nothing cached before this step: its own k/v, no gather
            kk, vv = k[start:end], v[start:end]
        else:
            kk = gather_sequence(k_cache, meta.block_tables[b], kv_len)
            vv = gather_sequence(v_cache, meta.block_tables[b], kv_len)
        kk, vv = kk.transpose(0, 1).float(), vv.transpose(0, 1).float()  # [Hkv, L, D]
        if sinks is not None:  # the sink's key and value: zeros (see the module docstring)
            kk = torch.cat([kk, kk.new_zeros((kk.shape[0], 1, kk.shape[2]))], dim=1)
            vv = torch.cat([vv, vv.new_zeros((vv.shape[0], 1, vv.shape[2]))], dim=1)
        mask = _mask(q_len, kv_len, Hq, q.device, sliding_window=sliding_window, attention_chunk=attention_chunk,
                     slopes=slopes, sinks=sinks)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1).float(), kk, vv, attn_mask=mask,
                                           scale=scale, enable_gqa=Hq != kk.shape[0])
        out[start:end] = o.transpose(0, 1).to(q.dtype)
        start = end
    return out
