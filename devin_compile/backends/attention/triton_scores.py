"""Triton side output for KV pruning: attention mass per cached slot, from the attention's LSE.

``triton_paged_attention(..., lse=)`` stores, for each (token, query head) row, the log2 of
its softmax normaliser in the kernel's base-2 units (``m + log2(l)``). ``_attn_mass_kernel``
then makes one pass over the keys: grid ``(num_seqs, cdiv(max_seq_len, BLOCK_N), Hkv)``;
program ``(b, n, h)`` loads the key tile ``n`` of sequence b's KV head h once, walks the
sequence's (query token, group head) rows in BLOCK_M tiles, recomputes each score exactly as
the attention kernel does (scale, soft-cap, causal-by-slot and window visibility), and sums
``exp2(s - lse)`` over the rows: the softmax mass the step's queries put on each slot, summed
over the group's query heads (what ``backends/attention/attention_scores.py`` defines). Output: float32
``[num_seqs, Hkv, max_seq_len]``, zero past each sequence's ``seq_len``.
"""
from __future__ import annotations

import torch

from ...step import AttentionMetadata
from .triton_common import interpreting, pow2, tl, triton


def _attn_mass_kernel(
    q_ptr, kc_ptr, lse_ptr, mass_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, softcap, sliding_window,
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_lt, stride_lh,
    stride_mb, stride_mh, stride_mn,
    stride_btb, stride_btm,
    GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    pid_n = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    kv_len = tl.load(seq_lens_ptr + seq)
    ctx_len = kv_len - q_len

    j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < kv_len
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    page = tl.load(bt_row + (j // PAGE) * stride_btm, mask=j_ok, other=0).to(tl.int64)
    off = (j % PAGE).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    k_base = page * stride_kcb + off * stride_kcs + kvh * stride_kch
    kt = tl.load(kc_ptr + k_base[None, :] + d[:, None] * stride_kcd,
                 mask=j_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    qk_scale = scale * 1.4426950408889634

    mass = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(0, q_len * GROUP, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        qi = rows // GROUP
        heads = kvh * GROUP + rows % GROUP
        row_ok = qi < q_len
        qpos = ctx_len + qi
        tok = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE_DOT:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt.to(q.dtype))
        if HAS_SOFTCAP:
            s = (2.0 * tl.sigmoid((2.0 * scale / softcap) * s) - 1.0) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        lse = tl.load(lse_ptr + tok * stride_lt + heads * stride_lh, mask=row_ok, other=0.0)
        visible = (j[None, :] <= qpos[:, None]) & j_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            visible = visible & (j[None, :] > qpos[:, None] - sliding_window)
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        mass += tl.sum(p, 0)
    tl.store(mass_ptr + seq.to(tl.int64) * stride_mb + kvh * stride_mh + j * stride_mn, mass, mask=j_ok)


_JITTED: dict[bool, object] = {}


def _kernel():
    key = interpreting()
    if key not in _JITTED:
        _JITTED[key] = triton.jit(_attn_mass_kernel)
    return _JITTED[key]


def triton_attention_mass(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, lse: torch.Tensor, *,
                          scale: float, softcap: float = 0.0, sliding_window: int = -1) -> torch.Tensor:
    """float32 [num_seqs, Hkv, max_seq_len]: per-slot attention mass (see module docstring)."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    B, L = meta.num_seqs, meta.max_seq_len
    mass = torch.zeros((B, Hkv, max(L, 1)), dtype=torch.float32, device=q.device)
    if T == 0 or B == 0 or L == 0:
        return mass
    interp = interpreting()
    block_m, block_n = 16, 32 if interp else 64
    bt = meta.block_tables
    _kernel()[(B, triton.cdiv(L, block_n), Hkv)](
        q, k_cache, lse, mass,
        bt, meta.seq_lens, meta.query_start_loc,
        float(scale), float(softcap) if softcap > 0 else 1.0, int(sliding_window),
        *q.stride(), *k_cache.stride(), *lse.stride(), *mass.stride(), bt.stride(0), bt.stride(1),
        GROUP=G, PAGE=k_cache.shape[1], HEAD_DIM=D, BLOCK_D=pow2(D),
        BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SOFTCAP=softcap > 0, HAS_WINDOW=sliding_window > 0,
        IEEE_DOT=q.dtype == torch.float32 or (interp and q.dtype == torch.bfloat16),
        num_warps=1 if interp else 4,
    )
    return mass
