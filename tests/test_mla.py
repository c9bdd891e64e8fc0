"""Multi-head latent attention (DeepSeek-V2/V3): the latent paged cache, absorbed decode against the
expanded oracle, and the runtime paths the family tests do not cover.

Teacher-forced logits, a padded batch and greedy parity with HF eager for deepseek_v2 / deepseek_v3
run in test_families.py through ``conftest.FAMILIES``.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FAMILIES, build_model
from devin_compile import optimize
from devin_compile.backends.attention.mla import absorbed_decode, expanded_attention, mla_forward, write_latent
from devin_compile.capture.model_info import ModelInfo
from devin_compile.pipeline import PassError
from devin_compile.runtime.kv_cache import KVCacheSpec
from devin_compile.step import AttentionMetadata


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- kernels


@st.composite
def steps(draw):
    """A random step over a random latent cache: decode / fresh prefill / chunked prefill rows."""
    bs = draw(st.sampled_from([2, 4, 16]))
    H, dn, dv, R, dr = (draw(st.sampled_from([1, 3, 4])), draw(st.sampled_from([4, 8])),
                        draw(st.sampled_from([4, 16])), draw(st.sampled_from([8, 32])), draw(st.sampled_from([2, 8])))
    shapes = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["decode", "decode", "prefill", "chunk"]))
        ctx = draw(st.integers(0, 30)) if kind != "prefill" else 0
        q = 1 if kind == "decode" else draw(st.integers(1, 9))
        shapes.append((q, ctx))
    return bs, (H, dn, dv, R, dr), shapes, draw(st.integers(0, 2**31 - 1))


def _build(bs, dims, shapes, seed):
    H, dn, dv, R, dr = dims
    g = torch.Generator().manual_seed(seed)
    need = [-(-(q + c) // bs) for q, c in shapes]
    num_blocks = 1 + sum(need)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    qlens, lens, tables, slots = [], [], [], []
    for (q, c), n in zip(shapes, need):
        table = [free.pop() for _ in range(n)]
        qlens.append(q)
        lens.append(q + c)
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(c, c + q)]
    meta = AttentionMetadata.build(qlens, lens, tables, slots)
    T = len(slots)
    cache = torch.randn((num_blocks, bs, 1, R + dr), generator=g)  # cached context (and stale rows)
    args = (torch.randn(T, H, dn, generator=g), torch.randn(T, H, dr, generator=g), torch.randn(T, R, generator=g),
            torch.randn(T, dr, generator=g), torch.randn(H * (dn + dv), R, generator=g) * 0.3)
    return meta, cache, args


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps())
def test_absorbed_decode_matches_expanded_oracle(step):
    meta, cache, (qn, qr, lat, kr, w) = _build(*step)
    scale = 0.37
    ref_cache = cache.clone()
    write_latent(lat, kr, ref_cache, meta.slot_mapping)
    want = expanded_attention(qn, qr, ref_cache, meta, w, scale)
    got = mla_forward(qn, qr, lat, kr, cache, meta, w, scale)  # decode rows absorbed, the rest expanded
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    decode = [b for b, n in enumerate(meta.query_lens_host) if n == 1]
    if decode:  # the absorbed path alone, on the decode rows
        out = torch.zeros_like(want)
        absorbed_decode(qn, qr, ref_cache, meta, w, scale, decode, out)
        rows = [meta.query_start_loc.tolist()[b] for b in decode]
        torch.testing.assert_close(out[rows], want[rows], atol=1e-4, rtol=1e-4)


def test_expanded_oracle_is_deepseek_attention():
    """One sequence by hand: K = [W_k c | k_rope], V = W_v c, softmax(q·K·scale) V with causality."""
    meta, cache, (qn, qr, lat, kr, w) = _build(4, (2, 4, 6, 8, 2), [(5, 3)], seed=1)
    write_latent(lat, kr, cache, meta.slot_mapping)
    out = expanded_attention(qn, qr, cache, meta, w, 0.5)
    rows = torch.cat([cache[b, :, 0] for b in meta.block_tables_host[0]])[:8]  # [8, R+dr] in slot order
    c, k_rope = rows[:, :8], rows[:, 8:]
    W = w.view(2, 10, 8)
    for h in range(2):
        K = torch.cat([c @ W[h, :4].T, k_rope], dim=-1)
        V = c @ W[h, 4:].T
        for i in range(5):
            s = K[: 3 + i + 1] @ torch.cat([qn[i, h], qr[i, h]]) * 0.5
            torch.testing.assert_close(out[i, h], torch.softmax(s, 0) @ V[: 3 + i + 1], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- layout


def test_latent_cache_bytes_per_token_on_deepseek_v3_shapes():
    """DeepSeek-V3's attention shapes (128 heads, qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512):
    576 values per token and layer instead of 128·(192 + 128) = 40960, 71x less."""
    info = ModelInfo("deepseek_v3", 61, 128, 128, 64, 129280, 4096, torch.bfloat16, torch.device("cpu"), [1],
                     mla=(512, 64))
    latent = KVCacheSpec(61, dtype=torch.bfloat16, block_size=16, **info.kv_cache_layout)
    expanded_per_layer = 128 * (128 + 64) + 128 * 128  # K heads (nope + rope) and V heads
    assert latent.bytes_per_token == 61 * 576 * 2
    assert latent.bytes_per_token * 4 <= 61 * expanded_per_layer * 2
    assert round(61 * expanded_per_layer * 2 / latent.bytes_per_token) == 71


def _model(family):
    fam = FAMILIES[family]
    return build_model(fam.model_type, fam.config_kwargs(), "eager")


def test_compiled_graph_keeps_latents_only():
    model = _model("deepseek_v3")
    opt = optimize(model, attention_backend="torch_reference", num_kv_blocks=16)
    cfg = model.config
    spec = opt.engine.runner.kv_cache.spec
    assert (spec.planes, spec.num_kv_heads, spec.head_dim) == (1, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    for gm in opt.program.graphs.values():
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        # the K/V expansion is gone: no kv_b_proj matmul and no in-place key fills left
        assert not [n for n in nodes if n.target in (torch.ops.aten.copy_.default, torch.ops.aten.new_empty.default)]
        kv_b = {n.args[4].target for n in nodes if n.target == torch.ops.devin.mla_attention.default}
        assert len(kv_b) == cfg.num_hidden_layers
        assert not [n for n in nodes if any(getattr(a, "target", None) in kv_b for a in n.args)
                    and n.target != torch.ops.devin.mla_attention.default]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_mla_prefix_caching_and_chunked_prefill_match_hf(family):
    model = _model(family)
    opt = optimize(model, block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    g = torch.Generator().manual_seed(3)
    pre = torch.randint(3, 256, (13,), generator=g).tolist()
    prompts = [pre + torch.randint(3, 256, (n,), generator=g).tolist() for n in (2, 7, 10)]

    def hf(p, n):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        return out[0, len(p):].tolist()

    assert opt.generate(prompts[:1], max_new_tokens=6, ignore_eos=True) == [hf(prompts[0], 6)]
    got = opt.generate(prompts[1:], max_new_tokens=[12, 9], ignore_eos=True)  # reuse the preamble's blocks
    assert got == [hf(prompts[1], 12), hf(prompts[2], 9)]
    assert opt.engine.kv_stats()["prefix_hit_tokens"] >= 2 * 12


def test_mla_with_kv_pruning_is_refused():
    with pytest.raises(PassError, match=r"multi-head latent attention.*drop kv_prune="):
        optimize(_model("deepseek_v3"), num_kv_blocks=16,
                 kv_prune=dict(threshold=0.0, step_interval=2, sink_tokens=2, recent_tokens=4, max_tokens=20))


def test_mla_latent_blocks_restore_from_a_host_tier():
    """MLA's one-plane latent blocks go to a host tier when the pool evicts them and come back
    (the KV block codec carries the pool's planes), with greedy output unchanged."""
    model = _model("deepseek_v3")
    kw = dict(attention_backend="torch_reference", block_size=4, num_kv_blocks=12)
    opt = optimize(model, kv_cache_tiers=[{"backend": "host_lru", "max_bytes": 1 << 22}], **kw)
    ref = optimize(model, enable_prefix_caching=False, **kw)
    g = torch.Generator().manual_seed(5)
    pre = torch.randint(3, 256, (28,), generator=g).tolist()
    filler = torch.randint(3, 256, (40,), generator=g).tolist()  # evicts the preamble's cached blocks
    prompt = pre + torch.randint(3, 256, (5,), generator=g).tolist()
    first = opt.generate([pre], max_new_tokens=3, ignore_eos=True)
    opt.generate([filler], max_new_tokens=3, ignore_eos=True)
    again = opt.generate([prompt], max_new_tokens=6, ignore_eos=True)
    assert first == ref.generate([pre], max_new_tokens=3, ignore_eos=True)
    assert again == ref.generate([prompt], max_new_tokens=6, ignore_eos=True)
    assert opt.engine.runner.kv_cache.spec.planes == 1
    stats = opt.engine.kv_stats()
    assert stats["kv_tier_loaded_blocks"] >= 1, stats
