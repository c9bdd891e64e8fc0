"""Contract test for the FlashAttention adapters (devin_compile/backends/flash_attn.py).

No GPU and no FlashAttention here, so the adapters run against stand-ins that implement
the *documented* ``flash_attn_with_kvcache`` contracts on CPU:

* FA2 (``flash_attn/flash_attn_interface.py``): q ``(batch, seqlen_q, nheads, headdim)``;
  paged ``k_cache``/``v_cache`` ``(num_blocks, page_block_size, nheads_k, headdim)`` with
  ``page_block_size`` a multiple of 256; ``block_table`` ``(batch, max_blocks)`` int32;
  ``cache_seqlens`` ``(batch,)`` int32.
* FA3 (``hopper/flash_attn_interface.py``): the same, with ``page_table`` (any page size),
  head dim a multiple of 8, and optionally a packed q ``(total_q, nheads, headdim)`` with
  ``cu_seqlens_q`` ``(batch + 1,)`` int32 and ``max_seqlen_q``.

Both stand-ins compute the documented semantics in float32: the causal mask aligned to the
bottom right (query ``i`` of ``seqlen_q`` sees keys ``<= i + seqlen_k - seqlen_q``), local
window ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``, softcap
``softcap * tanh(scale * q.k / softcap)``, FA3's ``attention_chunk`` C (keys from
``floor((i + seqlen_k - seqlen_q) / C)·C`` on, as hopper/mask.h limits a local row), and
all-masked rows returning zeros. The adapters must then match ``reference_paged_attention``
on random mixed batches.
"""
from __future__ import annotations

import inspect
import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devin_compile.backends.attention import flash_attn as fa
from devin_compile.backends.attention.flash_attn import FlashAttn2Backend, FlashAttn3Backend, window_size_for
from devin_compile.backends.attention.torch_reference import TorchReferenceBackend
from devin_compile.step import AttentionMetadata

HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------
# Stand-ins
# ----------------------------------------------------------------------------------------

def _fa_math(q: torch.Tensor, k_cache, v_cache, table_row, kv_len: int, *, scale, causal, window, softcap,
             alibi=None, chunk=0):
    """Documented FA semantics for one batch row. q [Sq, Hq, D] -> [Sq, Hq, Dv] float32."""
    Sq, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    Dv = v_cache.shape[-1]
    if kv_len == 0:
        return torch.zeros((Sq, Hq, Dv))
    nblk = (kv_len + page - 1) // page
    blocks = table_row[:nblk].long()
    assert int(blocks.min()) >= 0 and int(blocks.max()) < k_cache.shape[0], "block table entry out of range"
    kk = k_cache[blocks].reshape(-1, Hkv, D)[:kv_len].float()
    vv = v_cache[blocks].reshape(-1, Hkv, Dv)[:kv_len].float()
    G = Hq // Hkv
    qq = q.float().reshape(Sq, Hkv, G, D)  # head h of q uses kv head h // G
    s = torch.einsum("qhgd,khd->hgqk", qq, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    if causal:
        right = 0
    i = torch.arange(Sq)[:, None] + (kv_len - Sq)  # bottom-right alignment
    j = torch.arange(kv_len)[None, :]
    if alibi is not None:  # FA2: "-alibi_slope * |i + seqlen_k - seqlen_q - j|" added to the scores
        s = s - alibi.float().reshape(Hkv, G, 1, 1) * (i - j).abs().float()
    mask = torch.ones((Sq, kv_len), dtype=torch.bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    if chunk > 0:  # FA3: a row sees keys from the start of its own chunk on
        mask &= j >= torch.div(i, chunk, rounding_mode="floor") * chunk
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(mask.any(-1)[:, None], p, torch.zeros_like(p))  # all-masked row -> zeros
    return torch.einsum("hgqk,khd->qhgd", p, vv).reshape(Sq, Hq, Dv)


def _check_common(q, k_cache, v_cache, k, v, cache_seqlens, table, table_name, causal, window_size,
                  softcap, softmax_scale, batch):
    assert q.dtype in HALF, "FlashAttention only supports fp16 and bf16"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "query and key/value must have the same dtype"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k is None and v is None, "adapter contract: the cache is written beforehand, k/v must be None"
    assert k_cache.dim() == 4 and v_cache.dim() == 4, "paged k_cache must be (num_blocks, page_block_size, nheads_k, headdim)"
    assert v_cache.shape[:3] == k_cache.shape[:3]
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    assert k_cache.shape[3] == head_dim
    assert head_dim <= 256
    assert num_heads % k_cache.shape[2] == 0, "Number of heads in key/value must divide number of heads in query"
    assert isinstance(table, torch.Tensor), f"{table_name} required (paged KV)"
    assert table.dtype == torch.int32, f"{table_name} must have dtype torch.int32"
    assert table.dim() == 2 and table.shape[0] == batch and table.stride(-1) == 1
    assert isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32, "seqlens_k must be int32"
    assert cache_seqlens.shape == (batch,) and cache_seqlens.is_contiguous()
    assert int(cache_seqlens.max()) <= table.shape[1] * k_cache.shape[1], "cache_seqlens exceed the block table"
    assert isinstance(causal, bool)
    assert isinstance(window_size, tuple) and len(window_size) == 2 and all(isinstance(w, int) for w in window_size)
    assert isinstance(softcap, float) and softcap >= 0
    assert isinstance(softmax_scale, float)


def make_fa2_stand_in():
    calls: list[dict] = []

    def flash_attn_with_kvcache(
        q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
        cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    ):
        assert rotary_cos is None and rotary_sin is None
        if alibi_slopes is not None:
            assert alibi_slopes.dtype == torch.float32 and alibi_slopes.shape == (q.shape[2],), \
                "alibi_slopes must be fp32 (nheads,)"
        assert cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx"
        assert cache_leftpad is None
        assert q.dim() == 4, "FA2 q is (batch_size, seqlen, nheads, headdim)"
        B, Sq = q.shape[:2]
        _check_common(q, k_cache, v_cache, k, v, cache_seqlens, block_table, "block_table", causal,
                      window_size, softcap, softmax_scale, B)
        assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        assert v_cache.shape == k_cache.shape, "FA2 kvcache needs headdim_v == headdim"
        calls.append({"q_shape": tuple(q.shape)})
        out = torch.stack([
            _fa_math(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]), scale=softmax_scale,
                     causal=causal, window=window_size, softcap=softcap, alibi=alibi_slopes)
            for b in range(B)
        ]).to(q.dtype)
        return (out, None) if return_softmax_lse else out

    flash_attn_with_kvcache.calls = calls
    return flash_attn_with_kvcache


def make_fa3_stand_in(*, with_varlen: bool = True):
    calls: list[dict] = []

    def flash_attn_with_kvcache(
        q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
        cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
        cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
        q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
        window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
        scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False,
    ):
        assert qv is None and rotary_cos is None and rotary_sin is None and cu_seqlens_k_new is None
        assert cache_batch_idx is None and cache_leftpad is None
        assert isinstance(attention_chunk, int) and attention_chunk >= 0
        assert q.shape[-1] % 8 == 0, "head_size should be a multiple of 8"
        if cu_seqlens_q is not None:
            assert q.dim() == 3, "varlen q is (total_q, nheads, headdim)"
            assert isinstance(max_seqlen_q, int), "max_seqlen_q must be provided if cu_seqlens_q is provided"
            assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
            assert cu_seqlens_q.dim() == 1
            B = cu_seqlens_q.shape[0] - 1
            cu = cu_seqlens_q.tolist()
            assert cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= q.shape[0]
            assert max(b - a for a, b in zip(cu, cu[1:])) <= max_seqlen_q
            rows = [(cu[b], cu[b + 1]) for b in range(B)]
        else:
            assert q.dim() == 4, "q is (batch_size, seqlen, nheads, headdim)"
            B, Sq = q.shape[:2]
            rows = None
        _check_common(q, k_cache, v_cache, k, v, cache_seqlens, page_table, "page_table", causal,
                      window_size, softcap, softmax_scale, B)
        calls.append({"q_shape": tuple(q.shape), "varlen": cu_seqlens_q is not None, "chunk": attention_chunk})
        out = torch.zeros((*q.shape[:-1], v_cache.shape[-1]), dtype=q.dtype)
        for b in range(B):
            qb = q[rows[b][0]:rows[b][1]] if rows else q[b]
            ob = _fa_math(qb, k_cache, v_cache, page_table[b], int(cache_seqlens[b]), scale=softmax_scale,
                          causal=causal, window=window_size, softcap=softcap, chunk=attention_chunk).to(q.dtype)
            if rows:
                out[rows[b][0]:rows[b][1]] = ob
            else:
                out[b] = ob
        return (out, None) if return_softmax_lse else out

    if not with_varlen:  # the same function without the packed-query arguments in its signature
        def without_varlen(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
            return flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                           page_table=page_table, softmax_scale=softmax_scale, causal=causal,
                                           window_size=window_size, softcap=softcap)
        without_varlen.calls = calls
        return without_varlen
    flash_attn_with_kvcache.calls = calls
    return flash_attn_with_kvcache


# ----------------------------------------------------------------------------------------
# Random batches
# ----------------------------------------------------------------------------------------

@st.composite
def batch_specs(draw, *, block_sizes, max_ctx, max_q, head_dims):
    """(per-sequence (kind, ctx, q_len, seq_len), block_size, Hkv, G, D, dtype, window, softcap, extra, seed)."""
    block_size = draw(st.sampled_from(block_sizes))
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["prefill", "chunk", "decode", "decode", "pad"]))
        if kind == "prefill":
            ctx, q_len = 0, draw(st.integers(1, max_q))
        elif kind == "chunk":
            ctx, q_len = draw(st.integers(1, max_ctx)), draw(st.integers(1, max_q))
        elif kind == "decode":
            ctx, q_len = draw(st.integers(0, max_ctx)), 1
        else:  # padded decode slot: one token, nothing written, reads 0 or 1 (stale) slots
            ctx, q_len = 0, 1
        seq_len = draw(st.integers(0, 1)) if kind == "pad" else ctx + q_len
        seqs.append((kind, ctx, q_len, seq_len))
    return dict(
        seqs=seqs, block_size=block_size,
        hkv=draw(st.sampled_from([1, 2])), groups=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from(head_dims)), dtype=draw(st.sampled_from(HALF)),
        window=draw(st.sampled_from([-1, -1, 1, 3, 17])), softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 30.0])),
        extra=draw(st.sampled_from([0, 0, 0, 2])), seed=draw(st.integers(0, 2**31 - 1)),
    )


def build_case(spec):
    g = torch.Generator().manual_seed(spec["seed"])
    bs, dtype = spec["block_size"], spec["dtype"]
    hkv, D = spec["hkv"], spec["head_dim"]
    hq = hkv * spec["groups"]
    need = [max(1, math.ceil(s[3] / bs)) if s[0] != "pad" else 1 for s in spec["seqs"]]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    query_lens, seq_lens, tables, slots = [], [], [], []
    for (kind, ctx, q_len, seq_len), n in zip(spec["seqs"], need):
        if kind == "pad":
            table = [0]
            slots.append(-1)
        else:
            table = [perm.pop() for _ in range(n)]
            slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q_len)]
        query_lens.append(q_len)
        seq_lens.append(seq_len)
        tables.append(table)
    slots += [-1] * spec["extra"]  # trailing tokens owned by no sequence
    T = len(slots)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots)
    k_cache = torch.randn((num_blocks, bs, hkv, D), generator=g).to(dtype)
    v_cache = torch.randn((num_blocks, bs, hkv, D), generator=g).to(dtype)
    q = torch.randn((T, hq, D), generator=g).to(dtype)
    k = torch.randn((T, hkv, D), generator=g).to(dtype)
    v = torch.randn((T, hkv, D), generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, meta


def run_against_reference(backend, spec):
    q, k, v, k_cache, v_cache, meta = build_case(spec)
    scale = spec["head_dim"] ** -0.5
    kw = dict(scale=scale, softcap=spec["softcap"], sliding_window=spec["window"])
    if spec.get("alibi"):
        kw["alibi_slopes"] = torch.rand(q.shape[1], generator=torch.Generator().manual_seed(spec["seed"])) * 0.5
    if spec.get("chunk"):
        kw["attention_chunk"] = spec["chunk"]
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    want = TorchReferenceBackend().forward(q, k, v, kc_ref, vc_ref, meta, **kw)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, **kw)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref), "new K/V not written like the reference"
    tol = 1e-2 if q.dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return meta


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------
# Contract tests
# ----------------------------------------------------------------------------------------

@SETTINGS
@given(batch_specs(block_sizes=[256], max_ctx=600, max_q=20, head_dims=[8, 20, 32]))
def test_fa2_adapter_matches_reference(spec):
    stand_in = make_fa2_stand_in()
    meta = run_against_reference(FlashAttn2Backend(fn=stand_in), spec)
    (call,) = stand_in.calls
    B = meta.num_seqs
    assert call["q_shape"][:2] == ((B, 1) if meta.max_query_len == 1 else (B, meta.max_query_len))


@SETTINGS
@given(batch_specs(block_sizes=[1, 5, 16], max_ctx=40, max_q=12, head_dims=[8, 32]))
def test_fa3_adapter_matches_reference(spec):
    stand_in = make_fa3_stand_in()
    meta = run_against_reference(FlashAttn3Backend(fn=stand_in), spec)
    (call,) = stand_in.calls
    if meta.max_query_len == 1:
        assert call == {"q_shape": (meta.num_seqs, 1, call["q_shape"][2], call["q_shape"][3]), "varlen": False,
                        "chunk": 0}
    else:
        assert call["varlen"] and call["q_shape"][0] == sum(meta.query_lens_host)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_specs(block_sizes=[256], max_ctx=600, max_q=20, head_dims=[8, 32]))
def test_fa2_adapter_alibi_matches_reference(spec):
    """ALiBi slopes reach FA2's ``alibi_slopes`` and give the reference's slope·(key − query) bias."""
    stand_in = make_fa2_stand_in()
    backend = FlashAttn2Backend(fn=stand_in)
    assert backend.supports(dtype=torch.float16, head_dim=32, softcap=0.0, sliding_window=-1, alibi=True)
    run_against_reference(backend, dict(spec, alibi=True))


def test_fa3_declines_alibi():
    """FA3 has no ALiBi: the call is declined (it then runs on the torch reference)."""
    backend = FlashAttn3Backend(fn=make_fa3_stand_in())
    assert backend.supports(dtype=torch.float16, head_dim=32, softcap=0.0, sliding_window=-1)
    assert not backend.supports(dtype=torch.float16, head_dim=32, softcap=0.0, sliding_window=-1, alibi=True)


@settings(max_examples=10, deadline=None)
@given(batch_specs(block_sizes=[3, 16], max_ctx=40, max_q=12, head_dims=[16]))
def test_fa3_adapter_without_varlen_api_pads_queries(spec):
    stand_in = make_fa3_stand_in(with_varlen=False)
    meta = run_against_reference(FlashAttn3Backend(fn=stand_in), spec)
    (call,) = stand_in.calls
    assert not call["varlen"] and call["q_shape"][:2] == (meta.num_seqs, meta.max_query_len)


def test_left_padding_is_what_makes_bottom_right_causal_work():
    """One chunked-prefill row next to a decode row: the padded query must keep slot causality."""
    spec = dict(seqs=[("chunk", 300, 7, 307), ("decode", 5, 1, 6)], block_size=256, hkv=1, groups=2,
                head_dim=16, dtype=torch.float16, window=-1, softcap=0.0, extra=0, seed=0)
    run_against_reference(FlashAttn2Backend(fn=make_fa2_stand_in()), spec)
    run_against_reference(FlashAttn2Backend(fn=make_fa2_stand_in()), {**spec, "window": 4})


def test_window_size_convention():
    assert window_size_for(-1) == (-1, -1)
    assert window_size_for(0) == (-1, -1)
    assert window_size_for(1) == (0, 0)  # only the query's own slot
    assert window_size_for(4096) == (4095, 0)


def test_fa2_rejects_block_size_not_multiple_of_256():
    spec = dict(seqs=[("decode", 5, 1, 6)], block_size=16, hkv=1, groups=1, head_dim=16,
                dtype=torch.float16, window=-1, softcap=0.0, extra=0, seed=0)
    q, k, v, kc, vc, meta = build_case(spec)
    with pytest.raises(ValueError, match="block_size divisible by 256"):
        FlashAttn2Backend(fn=make_fa2_stand_in()).forward(q, k, v, kc, vc, meta, scale=0.25, softcap=0.0,
                                                          sliding_window=-1)


def test_rejects_cache_dtype_mismatch():
    spec = dict(seqs=[("decode", 5, 1, 6)], block_size=16, hkv=1, groups=1, head_dim=16,
                dtype=torch.float16, window=-1, softcap=0.0, extra=0, seed=0)
    q, k, v, kc, vc, meta = build_case(spec)
    with pytest.raises(ValueError, match="query dtype"):
        FlashAttn3Backend(fn=make_fa3_stand_in()).forward(q.bfloat16(), k, v, kc, vc, meta, scale=0.25,
                                                          softcap=0.0, sliding_window=-1)


@pytest.mark.parametrize("cls", [FlashAttn2Backend, FlashAttn3Backend])
def test_supports(cls):
    b = cls()
    ok = dict(head_dim=128, softcap=0.0, sliding_window=-1)
    assert b.supports(dtype=torch.float16, **ok) and b.supports(dtype=torch.bfloat16, **ok)
    assert not b.supports(dtype=torch.float32, **ok)
    assert not b.supports(dtype=torch.float16, head_dim=512, softcap=0.0, sliding_window=-1)
    assert b.supports(dtype=torch.float16, head_dim=128, softcap=30.0, sliding_window=4096)
    assert b.supports(dtype=torch.float16, block_size=256, **ok)
    assert b.supports(dtype=torch.float16, block_size=16, **ok) == (cls is FlashAttn3Backend)
    assert b.supports(dtype=torch.float16, head_dim=20, softcap=0.0, sliding_window=-1) == (cls is FlashAttn2Backend)


# ----------------------------------------------------------------------------------------
# Availability and registration (this machine: CPU only, no FlashAttention)
# ----------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
@pytest.mark.parametrize("backend", [FlashAttn2Backend(), FlashAttn3Backend(),
                                     FlashAttn2Backend(fn=make_fa2_stand_in()),
                                     FlashAttn3Backend(fn=make_fa3_stand_in())])
def test_unavailable_on_cpu_machine(backend):
    assert not backend.is_available(torch.device("cpu"))
    assert not backend.is_available(torch.device("cuda"))
    assert "flash_attn_interface" not in sys.modules or torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_registered_but_never_selected_on_cpu():
    from devin_compile.backends.attention.registry import backend_names, get_backend, select_attention_backend

    names = backend_names()
    assert {"flash_attn2", "flash_attn3"} <= set(names)
    assert get_backend("flash_attn3").priority == 40 and get_backend("flash_attn2").priority == 30
    assert select_attention_backend("cpu").name not in ("flash_attn2", "flash_attn3")
    with pytest.raises(ValueError, match="not available"):
        select_attention_backend("cpu", override="flash_attn2")


def test_forward_without_library_says_so():
    b = FlashAttn2Backend()
    b._modules = (("devin_no_such_module_for_test", "flash_attn_with_kvcache"),)
    with pytest.raises(RuntimeError, match="not importable"):
        b._library()


@pytest.mark.parametrize("module, make", [("flash_attn", make_fa2_stand_in),
                                          ("flash_attn_interface", make_fa3_stand_in)])
def test_stand_in_signature_matches_installed_library(module, make):
    """Where the real library is installed (GPU machines), the stand-in must mirror its signature."""
    lib = pytest.importorskip(module)
    real = list(inspect.signature(lib.flash_attn_with_kvcache).parameters)
    assert real == list(inspect.signature(make()).parameters)


def test_module_import_does_not_import_flash_attention():
    assert fa.__name__ == "devin_compile.backends.attention.flash_attn"
    if not torch.cuda.is_available():
        assert "flash_attn" not in sys.modules and "flash_attn_interface" not in sys.modules
