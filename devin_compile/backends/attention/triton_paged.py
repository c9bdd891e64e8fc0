"""Triton paged-attention backend (``"triton"``): KV write + varlen paged attention.

Two kernels run per ``devin::paged_attention`` call:

1. ``_kv_write_kernel`` -- grid ``(T,)``, one program per new token. It reads the
   token's flat slot ``s = meta.slot_mapping[t]`` and copies ``k[t]`` / ``v[t]``
   (all KV heads at once, a ``[BLOCK_H, BLOCK_D]`` tile) to
   ``cache[s // block_size, s % block_size]``, converting to the cache dtype. Slots
   ``< 0`` (padded decode entries) are masked off, so they never touch a page.

2. ``_paged_attn_kernel`` -- varlen flash attention over the paged cache, one launch
   for a whole mixed prefill + decode batch. Grid::

       (num_seqs, cdiv(max_query_len * G, BLOCK_M), Hkv)      G = Hq // Hkv

   Program ``(b, m, h)`` owns rows ``m*BLOCK_M .. m*BLOCK_M + BLOCK_M - 1`` of
   sequence ``b``'s flattened (query token, group head) pairs for KV head ``h``:
   row ``r`` is query token ``i = r // G`` of the sequence, query head ``h*G + r % G``.
   Folding the G query heads that share a KV head into the M dimension lets a decode
   step (q_len = 1) still fill a tile and reads each K/V page once per KV head.

   For its rows the program walks kv positions ``lo .. hi`` in ``BLOCK_N`` steps,
   looks each position's page up in the block table (``block_tables[b, j // block_size]``,
   so pages may be scattered and BLOCK_N need not equal block_size), and keeps a
   running max / running sum / fp32 accumulator (online softmax). ``hi`` stops at the
   last slot the tile's latest query may see; with a sliding window or an attention chunk
   ``lo`` starts at the first slot the tile's earliest query may see. Attention sinks start
   each row's running max at its head's sink logit and its running sum at 1 (the sink's own
   ``exp2(sink − max)``), with nothing added to the accumulator: the sink joins the
   denominator and attends to nothing.

Semantics (identical to :func:`torch_reference.reference_paged_attention`): query token
``i`` of a sequence with ``q_len`` new tokens and ``kv_len = seq_lens[b]`` cached tokens
(after this step's write) sits at slot ``qpos = kv_len - q_len + i`` and sees slots
``j <= qpos`` (and ``j > qpos - sliding_window`` when ``sliding_window > 0``, and
``j >= (qpos // attention_chunk) * attention_chunk`` when ``attention_chunk > 0``). Scores
are ``q.k * scale``, soft-capped as ``tanh(s / softcap) * softcap`` when ``softcap > 0``,
plus ``alibi_slopes[h] * (j - qpos)`` when ALiBi slopes are given; with ``sinks`` each
row's softmax denominator also holds ``exp(sinks[h])``.
Accumulation is fp32; the output has q's dtype. fp32 inputs use IEEE (not TF32) dots;
fp16/bf16 inputs use half-precision dots with fp32 accumulation (under the interpreter,
whose bf16 dot is broken, bf16 operands are upcast to fp32 instead).

Invariants the kernels rely on: ``query_start_loc`` is non-decreasing with
``query_start_loc[-1] == T``; ``q_len <= kv_len`` for every sequence with tokens;
every block-table entry below ``cdiv(kv_len, block_size)`` is a valid page; Hq is a
multiple of Hkv. head_dim is any value up to 256 (non-powers of two such as 80 or 96
are padded to the next power of two with load masks).

Triton is imported lazily-safe: without triton the module still imports and the
backend reports itself unavailable. On CPU the backend is only available with
``TRITON_INTERPRET=1`` (the Triton interpreter; slow, meant for tests). Kernels are
jitted on first use, so the interpreter setting in force at that moment applies.
"""
from __future__ import annotations

import torch

from ...step import AttentionMetadata
from .registry import register_backend

from .triton_common import HAVE_TRITON, interpreting, pow2, tl, triton

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------- kernels
# Plain functions here; ``_kernels()`` jits them on first use (see module docstring).


def _kv_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)
    # Per-head copy of "slot is real" (a vector, so every mask below is a plain bool tensor).
    h_ok = (h < NUM_KV_HEADS) & ((h * 0 + slot) >= 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    page = slot // PAGE
    off = slot % PAGE
    t64 = t.to(tl.int64)

    d = tl.arange(0, BLOCK_D)
    mask_k = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    kx = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask_k, other=0.0)
    kc_dst = kc_ptr + page * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :] * stride_kcd
    tl.store(kc_dst, kx.to(kc_ptr.dtype.element_ty), mask=mask_k)

    dv = tl.arange(0, BLOCK_DV)
    mask_v = h_ok[:, None] & (dv < HEAD_DIM_V)[None, :]
    vx = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + dv[None, :] * stride_vd, mask=mask_v, other=0.0)
    vc_dst = vc_ptr + page * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + dv[None, :] * stride_vcd
    tl.store(vc_dst, vx.to(vc_ptr.dtype.element_ty), mask=mask_v)


def _paged_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, lse_ptr, alibi_ptr, sinks_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, softcap, sliding_window, attention_chunk,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_btb, stride_btm,
    GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE_DOT: tl.constexpr,
    STORE_LSE: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    pid_m = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    kv_len = tl.load(seq_lens_ptr + seq)
    ctx_len = kv_len - q_len  # slot of query token 0 is ctx_len

    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    row_ok = qi < q_len
    qpos = ctx_len + qi

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < HEAD_DIM_V

    tok = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )

    # kv range this tile needs: up to the latest query's slot, from the earliest query's window.
    tile_live = row0 < q_len * GROUP
    last_qi = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    hi = tl.minimum(kv_len, ctx_len + last_qi + 1)
    hi = tl.where(tile_live, hi, 0)
    lo = hi * 0
    first_q = ctx_len + row0 // GROUP
    if HAS_WINDOW:
        lo = tl.maximum(lo, first_q - sliding_window + 1)
    if HAS_CHUNK:  # the earliest query's chunk start (positions are >= 0, so // is a floor)
        lo = tl.maximum(lo, (first_q // attention_chunk) * attention_chunk)
    lo = (tl.maximum(lo, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink as a key already seen: max = its logit, sum = exp2(0) = 1, no value
        m_i = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2
    if HAS_ALIBI:  # per-row slope, in the kernel's base-2 units
        slope = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        page = tl.load(bt_row + (j // PAGE) * stride_btm, mask=j_ok, other=0).to(tl.int64)
        off = (j % PAGE).to(tl.int64)

        k_base = page * stride_kcb + off * stride_kcs + kvh * stride_kch
        kt = tl.load(kc_ptr + k_base[None, :] + d[:, None] * stride_kcd,
                     mask=j_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if IEEE_DOT:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt.to(q.dtype))
        if HAS_SOFTCAP:
            # tanh(x) = 2 * sigmoid(2x) - 1; scores stay in natural units until the cap.
            s = (2.0 * tl.sigmoid((2.0 * scale / softcap) * s) - 1.0) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        if HAS_ALIBI:  # + slope_h * (key slot - query slot)
            s = s + slope[:, None] * (j[None, :] - qpos[:, None]).to(tl.float32)

        visible = (j[None, :] <= qpos[:, None]) & j_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (j[None, :] > qpos[:, None] - sliding_window)
        if HAS_CHUNK:
            visible = visible & (j[None, :] >= (qpos[:, None] // attention_chunk) * attention_chunk)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)

        v_base = page * stride_vcb + off * stride_vcs + kvh * stride_vch
        vv = tl.load(vc_ptr + v_base[:, None] + dv[None, :] * stride_vcd,
                     mask=j_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        if IEEE_DOT:
            pv = tl.dot(p, vv.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), vv.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if STORE_LSE:  # KV pruning side output: each row's log2-sum-exp2 of its scaled scores
        tl.store(lse_ptr + tok * stride_lt + heads * stride_lh, m_i + tl.log2(l_safe), mask=row_ok)
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :],
    )


_JITTED: dict[bool, tuple] = {}


def _kernels():
    """(kv_write, paged_attn) jitted for the current interpreter setting (cached)."""
    key = interpreting()
    if key not in _JITTED:
        _JITTED[key] = (triton.jit(_kv_write_kernel), triton.jit(_paged_attn_kernel))
    return _JITTED[key]


# --------------------------------------------------------------------------- host side


def _tiles(rows_per_seq: int, head_dim: int, interpreting: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a launch; rows_per_seq = max_query_len * G."""
    if interpreting:
        # The interpreter's cost is per tile op, so few, mid-sized tiles are fastest.
        return 16, 32, 1
    block_m = 16 if rows_per_seq <= 16 else (32 if rows_per_seq <= 32 else (64 if head_dim > 128 else 128))
    block_n = 32 if head_dim > 128 else 64
    num_warps = 4 if block_m <= 64 else 8
    return block_m, block_n, num_warps


def triton_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Scatter k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D]; slots < 0 are skipped."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    Dv = v.shape[-1]
    write, _ = _kernels()
    write[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=Hkv, BLOCK_H=pow2(Hkv, 1),
        HEAD_DIM=D, BLOCK_D=pow2(D, 1), HEAD_DIM_V=Dv, BLOCK_DV=pow2(Dv, 1),
        PAGE=k_cache.shape[1],
        num_warps=1 if interpreting() else 4,
    )


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, *, scale: float, softcap: float = 0.0,
                           sliding_window: int = -1, lse: torch.Tensor | None = None,
                           alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                           attention_chunk: int = -1) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the (already written) paged cache; [T, Hq, Dv] in q's dtype.

    With ``lse`` (float32 [T, Hq]) also stores each row's log2-sum-exp2 of its scores (in the
    kernel's base-2 units), which ``triton_scores`` turns into per-slot attention mass.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    Dv = v_cache.shape[-1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    G = Hq // Hkv
    out = torch.empty((T, Hq, Dv), dtype=q.dtype, device=q.device)
    B = meta.num_seqs
    if T == 0 or B == 0 or meta.max_query_len == 0:
        return out.zero_()
    interp = interpreting()
    block_m, block_n, num_warps = _tiles(meta.max_query_len * G, max(D, Dv), interp)
    grid = (B, triton.cdiv(meta.max_query_len * G, block_m), Hkv)
    bt = meta.block_tables
    _, attn = _kernels()
    lse_t = lse if lse is not None else out
    slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous() if alibi_slopes is not None else out
    sink_t = sinks.to(device=q.device, dtype=torch.float32).contiguous() if sinks is not None else out
    attn[grid](
        q, k_cache, v_cache, out, lse_t, slopes, sink_t,
        bt, meta.seq_lens, meta.query_start_loc,
        float(scale), float(softcap) if softcap > 0 else 1.0, int(sliding_window), max(int(attention_chunk), 1),
        *q.stride(), *out.stride(), lse_t.stride(0), lse_t.stride(1),
        *k_cache.stride(), *v_cache.stride(), bt.stride(0), bt.stride(1),
        GROUP=G, PAGE=k_cache.shape[1],
        HEAD_DIM=D, BLOCK_D=pow2(D), HEAD_DIM_V=Dv, BLOCK_DV=pow2(Dv),
        BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SOFTCAP=softcap > 0, HAS_WINDOW=sliding_window > 0,
        # fp32 inputs: IEEE fp32 dots (no TF32). The interpreter's bf16 dot is broken (it multiplies
        # the raw bits), so there bf16 operands are upcast and use the same fp32 path.
        IEEE_DOT=q.dtype == torch.float32 or (interp and q.dtype == torch.bfloat16),
        STORE_LSE=lse is not None, HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None,
        HAS_CHUNK=attention_chunk > 0,
        num_warps=num_warps, **({} if interp else {"num_stages": 2}),
    )
    return out


class TritonPagedBackend:
    name = "triton"
    priority = 20
    # decode steps read only the metadata tensors and its static host fields: CUDA-Graph capturable
    cuda_graph_safe = True

    def is_available(self, device: torch.device) -> bool:
        if not HAVE_TRITON:
            return False
        device = torch.device(device)
        if device.type == "cuda":
            return torch.cuda.is_available()
        return device.type == "cpu" and interpreting()

    def supports(self, *, dtype: torch.dtype, head_dim: int, softcap: float, sliding_window: int,
                 block_size: int | None = None, alibi: bool = False, sinks: bool = False,
                 attention_chunk: int = -1) -> bool:
        # Any block_size works: kv positions are mapped to pages one by one, not per tile.
        return HAVE_TRITON and dtype in _SUPPORTED_DTYPES and 0 < head_dim <= _MAX_HEAD_DIM

    def forward(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, alibi_slopes=None,
                sinks=None, attention_chunk=-1):
        triton_write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return triton_paged_attention(q, k_cache, v_cache, meta, scale=scale, softcap=softcap,
                                      sliding_window=sliding_window, alibi_slopes=alibi_slopes, sinks=sinks,
                                      attention_chunk=attention_chunk)

    def forward_with_scores(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, rows):
        """:meth:`forward` plus the attention mass of batch ``rows`` ({row: [Hkv, kv_len]}), from the
        kernel's row log-sum-exp and one more pass over the keys (``triton_scores``)."""
        from .triton_scores import triton_attention_mass

        triton_write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
        out = triton_paged_attention(q, k_cache, v_cache, meta, scale=scale, softcap=softcap,
                                     sliding_window=sliding_window, lse=lse)
        mass = triton_attention_mass(q, k_cache, meta, lse, scale=scale, softcap=softcap,
                                     sliding_window=sliding_window)
        return out, {b: mass[b, :, :meta.seq_lens_host[b]] for b in rows}


register_backend(TritonPagedBackend())
