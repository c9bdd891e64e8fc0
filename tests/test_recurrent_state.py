"""Recurrent state (issue 42 part 4): the Mamba2 core against oracles, the state pool's bookkeeping.

- ``mamba2_forward`` (the torch kernel of ``devin::mamba2_scan``) against a plain token-by-token recurrence
  written here (conv window shifted one token at a time, ``S ← exp(dt·A)·S + dt·x⊗B``, ``y = S·C + D·x``), over
  several sequences split into random steps (prefill chunks continuing from stored states, decode tokens,
  sequences mixed in one step), and its chunked form against transformers' own ``mamba2_chunk_scan``; the Mamba v1,
  gated DeltaNet and RG-LRU kernels over step splits against transformers' full-sequence paths;
- the pool: random admit / step / finish / abort / preempt sequences through a real Engine (a tiny Bamba with a
  KV pool small enough to preempt) never leak a slot, never share one, and never leave one to a sequence
  that is not running;
- what recurrent models refuse (a draft made from the target, KV pruning, compile_decode, tiers) and that prefix
  caching is off;
  a recurrent layer of another layout refused by name, one that computes something else refused on the probe.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FAMILIES, build_model
from devin_compile import optimize
from devin_compile.capture import UnsupportedModelError
from devin_compile.backends.recurrent.mamba2 import Mamba2Shape, mamba2_forward, scan_chunked
from devin_compile.backends.recurrent.step_rows import StepRows
from devin_compile.runtime.sampling import SamplingParams
from devin_compile.runtime.state_pool import StatePool


def _params(sh: Mamba2Shape, K: int, g: torch.Generator) -> dict:
    cd = sh.inner + 2 * sh.n_groups * sh.state_size
    return dict(conv_weight=torch.randn(cd, K, generator=g) * 0.5, conv_bias=torch.randn(cd, generator=g) * 0.1,
                dt_bias=torch.randn(sh.num_heads, generator=g) * 0.5,
                A_log=torch.log(torch.rand(sh.num_heads, generator=g) * 4 + 0.5),
                D=torch.randn(sh.num_heads, generator=g))


def _naive(xbc: torch.Tensor, dt: torch.Tensor, p: dict, sh: Mamba2Shape) -> torch.Tensor:
    """One sequence from scratch, one token at a time (float64)."""
    xbc, dt = xbc.double(), dt.double()
    w, b = p["conv_weight"].double(), p["conv_bias"].double()
    K, rep = w.shape[1], sh.num_heads // sh.n_groups
    window = torch.zeros(xbc.shape[1], K, dtype=torch.float64)
    S = torch.zeros(sh.num_heads, sh.head_dim, sh.state_size, dtype=torch.float64)
    A = -torch.exp(p["A_log"].double())
    ys = []
    for t in range(xbc.shape[0]):
        window = torch.cat([window[:, 1:], xbc[t][:, None]], dim=1)
        u = F.silu((window * w).sum(1) + b)
        x = u[:sh.inner].view(sh.num_heads, sh.head_dim)
        gn = sh.n_groups * sh.state_size
        B = u[sh.inner:sh.inner + gn].view(sh.n_groups, -1).repeat_interleave(rep, 0)
        C = u[sh.inner + gn:].view(sh.n_groups, -1).repeat_interleave(rep, 0)
        d = F.softplus(dt[t] + p["dt_bias"].double())
        S = S * torch.exp(d * A)[:, None, None] + (d[:, None] * x)[..., None] * B[:, None, :]
        ys.append(((S * C[:, None, :]).sum(-1) + p["D"].double()[:, None] * x).reshape(-1))
    return torch.stack(ys)


@st.composite
def _plans(draw):
    """Sizes, and per sequence its length and how it is cut into steps."""
    heads = draw(st.sampled_from([2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2) if heads % g == 0]))
    sh = Mamba2Shape(heads, draw(st.sampled_from([4, 8])), groups, draw(st.sampled_from([4, 8])),
                     draw(st.sampled_from([3, 4, 16])))
    lens = draw(st.lists(st.integers(1, 23), min_size=1, max_size=4))
    cuts = [sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3)))) if n > 1 else [] for n in lens]
    return sh, draw(st.sampled_from([2, 4])), lens, cuts, draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_mamba2_steps_match_token_by_token_recurrence(plan):
    sh, K, lens, cuts, seed = plan
    g = torch.Generator().manual_seed(seed)
    p = _params(sh, K, g)
    cd = sh.inner + 2 * sh.n_groups * sh.state_size
    seqs = [(torch.randn(n, cd, generator=g), torch.randn(n, sh.num_heads, generator=g)) for n in lens]
    pool = StatePool([((cd, K - 1), (sh.num_heads, sh.head_dim, sh.state_size))], len(lens) + 1)
    slots = [pool.allocate(f"s{i}") for i in range(len(lens))]
    # Each sequence's pieces: [0, c1), [c1, c2), ... ; step s runs piece s of every sequence that still has one.
    pieces = [list(zip([0] + c, c + [n])) for n, c in zip(lens, cuts)]
    outs = [[] for _ in lens]
    for s in range(max(len(pc) for pc in pieces)):
        rows = [(b, pc[s]) for b, pc in enumerate(pieces) if s < len(pc)]
        xbc = torch.cat([seqs[b][0][a:e] for b, (a, e) in rows])
        dt = torch.cat([seqs[b][1][a:e] for b, (a, e) in rows])
        plan = StepRows.plan([e - a for _b, (a, e) in rows], [a for _b, (a, e) in rows],
                             [slots[b] for b, _ in rows], "cpu")
        y = mamba2_forward(xbc, dt, p, sh, *pool.layer(0), plan)
        o = 0
        for b, (a, e) in rows:
            outs[b].append(y[o:o + e - a])
            o += e - a
    for b, n in enumerate(lens):
        want = _naive(*seqs[b], p, sh)
        got = torch.cat(outs[b]).double()
        assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), f"sequence {b} ({n} tokens, cut at {cuts[b]})"


def test_chunked_scan_matches_transformers():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    g = torch.Generator().manual_seed(3)
    L, H, P, G, N = 29, 4, 8, 2, 16
    x, dt = torch.randn(1, L, H, P, generator=g), torch.randn(1, L, H, generator=g)
    A = -torch.rand(H, generator=g) * 3
    B, C, D = torch.randn(1, L, G, N, generator=g), torch.randn(1, L, G, N, generator=g), torch.randn(H, generator=g)
    h0 = torch.randn(1, H, P, N, generator=g)
    d = F.softplus(dt[0])  # HF applies softplus only with dt_softplus=True: pass the same dt both ways
    want, want_h = mamba2_chunk_scan(x, d[None], A, B, C, 8, D=D, initial_states=h0, return_final_states=True)
    y, h = scan_chunked(x[0], d, A, B[0].repeat_interleave(2, 1), C[0].repeat_interleave(2, 1), D, h0[0], 8)
    assert torch.allclose(y, want[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(h, want_h[0], atol=1e-4, rtol=1e-4)


def test_selective_scan_matches_transformers_over_step_splits():
    """Mamba v1: conv + selective scan run as [prefill chunk, prefill chunk, decode, decode] steps of two
    sequences against transformers' own full-sequence torch path (causal_conv1d_fn + mamba_selective_scan)."""
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn, mamba_selective_scan

    from devin_compile.backends.recurrent.conv import causal_conv_step
    from devin_compile.backends.recurrent.mamba import selective_scan_step

    g = torch.Generator().manual_seed(5)
    I, N, K = 12, 6, 4
    w, b = torch.randn(I, K, generator=g) * 0.5, torch.randn(I, generator=g) * 0.1
    A_log, D, dt_bias = torch.randn(I, N, generator=g) * 0.5, torch.randn(I, generator=g), torch.randn(I, generator=g)
    lens, cuts = [13, 9], [[0, 5, 11, 12, 13], [0, 7, 8, 9]]
    data = [[torch.randn(n, I, generator=g) for _ in range(3)] + [torch.randn(n, N, generator=g) for _ in range(2)]
            for n in lens]  # x, dt, z, B, C
    pool = StatePool([((I, K - 1), (I, N))] * 1, 2)
    slots = [pool.allocate("a"), pool.allocate("b")]
    outs = [[], []]
    for s in range(4):
        rows_b = [b_ for b_ in range(2) if s + 1 < len(cuts[b_])]
        spans = [(cuts[b_][s], cuts[b_][s + 1]) for b_ in rows_b]
        cat = [torch.cat([data[b_][k][a:e] for b_, (a, e) in zip(rows_b, spans)]) for k in range(5)]
        rows = StepRows.plan([e - a for a, e in spans], [a for a, _ in spans], [slots[b_] for b_ in rows_b], "cpu")
        u = causal_conv_step(cat[0], w, b, pool.layer(0)[0], rows)
        y = selective_scan_step(u, cat[1], A_log, cat[3], cat[4], D, cat[2], dt_bias, pool.layer(0)[1], rows)
        o = 0
        for b_, (a, e) in zip(rows_b, spans):
            outs[b_].append(y[o:o + e - a])
            o += e - a
    for b_ in range(2):
        x, dt, z, B, C = data[b_]
        u = causal_conv1d_fn(x.t()[None], w, b, activation="silu")
        want = mamba_selective_scan(u, dt.t()[None], -torch.exp(A_log), B.t()[None], C.t()[None], D, z=z.t()[None],
                                    delta_bias=dt_bias, delta_softplus=True)[0].t()
        assert torch.allclose(torch.cat(outs[b_]), want, atol=1e-5, rtol=1e-4), f"sequence {b_}"


def test_gated_delta_rule_matches_transformers_over_step_splits():
    """Gated delta rule run as [prefill chunk, prefill chunk, decode, decode] steps of two sequences against
    transformers' chunked torch path over the whole sequences (torch_chunk_gated_delta_rule)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from devin_compile.backends.recurrent.gated_delta import gated_delta_step

    g = torch.Generator().manual_seed(9)
    Hk, Hv, Dk, Dv = 2, 4, 8, 6
    lens, cuts = [13, 9], [[0, 5, 11, 12, 13], [0, 7, 8, 9]]
    data = [(torch.randn(n, Hk, Dk, generator=g), torch.randn(n, Hk, Dk, generator=g),
             torch.randn(n, Hv, Dv, generator=g), -torch.rand(n, Hv, generator=g), torch.rand(n, Hv, generator=g))
            for n in lens]  # q, k, v, g, beta
    pool = StatePool([((1, 1), (Hv, Dk, Dv))], 2)
    slots = [pool.allocate("a"), pool.allocate("b")]
    outs = [[], []]
    for s in range(4):
        live = [b_ for b_ in range(2) if s + 1 < len(cuts[b_])]
        spans = [(cuts[b_][s], cuts[b_][s + 1]) for b_ in live]
        cat = [torch.cat([data[b_][k][a:e] for b_, (a, e) in zip(live, spans)]) for k in range(5)]
        rows = StepRows.plan([e - a for a, e in spans], [a for a, _ in spans], [slots[b_] for b_ in live], "cpu")
        o = gated_delta_step(*cat, pool.layer(0)[1], rows)
        off = 0
        for b_, (a, e) in zip(live, spans):
            outs[b_].append(o[off:off + e - a])
            off += e - a
    for b_ in range(2):
        q, k, v, gg, beta = (t[None] for t in data[b_])
        want, _ = torch_chunk_gated_delta_rule(q, k, v, g=gg, beta=beta, chunk_size=4, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        assert torch.allclose(torch.cat(outs[b_]), want[0], atol=1e-5, rtol=1e-4), f"sequence {b_}"


def test_rglru_conv_and_scan_match_transformers_over_step_splits():
    """RecurrentGemma: the conv without SiLU and the linear recurrence h_t = a_t·h_{t-1} + x_t run as [prefill
    chunk, prefill chunk, decode, decode] steps of two sequences against transformers' full-sequence path (its
    ``conv_1d`` with causal padding, ``RecurrentGemmaRglru._rnn_scan`` reset at position 0)."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    from devin_compile.backends.recurrent.conv import causal_conv_step
    from devin_compile.backends.recurrent.linear_scan import linear_scan_step

    g = torch.Generator().manual_seed(11)
    W, K = 10, 4
    w, b = torch.randn(W, K, generator=g) * 0.5, torch.randn(W, generator=g) * 0.1
    lens, cuts = [13, 9], [[0, 5, 11, 12, 13], [0, 7, 8, 9]]
    data = [(torch.randn(n, W, generator=g), torch.rand(n, W, generator=g), torch.randn(n, W, generator=g))
            for n in lens]  # conv input, a, x
    pool = StatePool([((W, K - 1), (W,))], 2)
    slots = [pool.allocate("a"), pool.allocate("b")]
    conv_out, scan_out = [[], []], [[], []]
    for s in range(4):
        live = [b_ for b_ in range(2) if s + 1 < len(cuts[b_])]
        spans = [(cuts[b_][s], cuts[b_][s + 1]) for b_ in live]
        cat = [torch.cat([data[b_][k][a:e] for b_, (a, e) in zip(live, spans)]) for k in range(3)]
        rows = StepRows.plan([e - a for a, e in spans], [a for a, _ in spans], [slots[b_] for b_ in live], "cpu")
        u = causal_conv_step(cat[0], w, b, pool.layer(0)[0], rows, silu=False)
        h = linear_scan_step(cat[1], cat[2], pool.layer(0)[1], rows)
        off = 0
        for b_, (a, e) in zip(live, spans):
            conv_out[b_].append(u[off:off + e - a])
            scan_out[b_].append(h[off:off + e - a])
            off += e - a
    for b_, n in enumerate(lens):
        u, a, x = data[b_]
        want_u = F.conv1d(u.t()[None], w[:, None, :], b, padding=K - 1, groups=W)[0, :, :n].t()
        reset = (torch.arange(n) == 0)[None, :, None]
        want_h, _ = RecurrentGemmaRglru._rnn_scan(None, x[None], a[None], reset, None)
        assert torch.allclose(torch.cat(conv_out[b_]), want_u, atol=1e-5, rtol=1e-4), f"conv, sequence {b_}"
        assert torch.allclose(torch.cat(scan_out[b_]), want_h[0], atol=1e-5, rtol=1e-4), f"scan, sequence {b_}"


def test_state_pool_slots():
    pool = StatePool([((3, 2), (2, 2, 2))], 2)
    a = pool.allocate("a")
    pool.layer(0)[1][a].fill_(5.0)
    pool.free(a)
    b, c = pool.allocate("b"), pool.allocate("c")
    assert {b, c} == {0, 1} and pool.num_free == 0
    assert float(pool.layer(0)[1][a].abs().sum()) == 0.0, "a slot is zeroed when taken"
    with pytest.raises(RuntimeError, match="slots are all taken"):
        pool.allocate("d")
    pool.free(b)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(b)


# --------------------------------------------------------------------------- the pool under a real engine

@pytest.fixture(scope="module")
def bamba_engine(tiny_model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimize(tiny_model("bamba", "eager"), attention_backend="torch_reference", block_size=4,
                       num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=4)
    return opt.engine


def _check_pool(engine) -> None:
    pool = engine.runner.state_pool
    running = engine.scheduler.running
    owners = pool.owners()
    held = {s.state_slot: s.request_id for s in running}
    assert len(held) == len(running) and -1 not in held, "every running sequence holds its own slot"
    assert owners == held, f"slots held by non-running sequences or leaked: {owners} vs {held}"
    assert all(s.state_slot == -1 for s in engine.scheduler.waiting), "a waiting sequence holds a slot"
    assert pool.num_free + len(owners) == pool.num_slots


_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("preempt"), st.integers(0, 10), st.just(0))), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(_OPS, st.integers(0, 2**16))
def test_state_pool_never_leaks(bamba_engine, ops, seed):
    engine = bamba_engine
    g = torch.Generator().manual_seed(seed)
    ids = []
    for op, a, b in ops:
        if op == "add":
            ids.append(engine.add_request(torch.randint(3, 256, (a,), generator=g).tolist(),
                                          SamplingParams(max_new_tokens=b, ignore_eos=True)))
        elif op == "step":
            for _ in range(a):
                if engine.has_unfinished():
                    engine.step()
                    _check_pool(engine)
        elif op == "abort" and ids:
            engine.abort(ids[a % len(ids)])
        elif op == "preempt" and engine.scheduler.running:  # what the scheduler does when blocks run out
            victim = engine.scheduler.running[a % len(engine.scheduler.running)]
            engine.scheduler._preempt(victim, type("Plan", (), {"preempted": []})())
        _check_pool(engine)
    while engine.has_unfinished():
        engine.step()
        _check_pool(engine)
    assert engine.runner.state_pool.num_free == engine.runner.state_pool.num_slots
    for rid in ids:
        engine.forget(rid)


# --------------------------------------------------------------------------- what recurrent models refuse

@pytest.mark.parametrize("option, pattern", [
    (dict(speculative=dict(method="head", layers=1, last_layers=0)),
     "speculative= with a draft made from the target is not supported"),
    (dict(kv_prune=dict(max_tokens=128)), "kv_prune= is not supported"),
    (dict(compile_decode=True), "compile_decode=True is not supported"),
])
def test_recurrent_models_refuse_stateless_features(tiny_model, option, pattern):
    with pytest.raises(ValueError, match=pattern):
        optimize(tiny_model("bamba", "eager"), num_kv_blocks=8, **option)


def test_prefix_caching_is_off_for_recurrent_models(bamba_engine):
    assert bamba_engine.kv.prefix_cache is None
    assert FAMILIES["bamba"].model_type == "bamba"


def _fresh(family: str):
    """A model of ``family`` built anew (the cached ``tiny_model`` ones must not be changed)."""
    fam = FAMILIES[family]
    return build_model(fam.model_type, fam.config, fam.impls[-1])


def test_recurrent_layer_of_another_layout_is_refused_by_name():
    """A short convolution missing a part the recognised layout has is not guessed at: refused naming it."""
    model = _fresh("lfm2")
    conv = next(m for m in model.modules() if type(m).__name__ == "Lfm2ShortConv")
    del conv.conv_kernel_size
    with pytest.raises(UnsupportedModelError, match=r"\(Lfm2ShortConv\): a short causal convolution of another "
                                                    r"layout .* Way out"):
        optimize(model, num_kv_blocks=8)


def test_mixer_computing_something_else_is_refused_on_the_probe():
    """A Mamba2 mixer whose forward computes something other than the recognised layout (here its output scaled
    after out_proj) fails the probe against its own forward and is refused, never compiled silently."""
    model = _fresh("bamba")
    mixer = next(m for m in model.modules() if type(m).__name__ == "BambaMixer")
    mixer.forward = lambda h, *a, **k: type(mixer).forward(mixer, h, *a, **k) * 1.01
    with pytest.raises(UnsupportedModelError, match=r"\(BambaMixer\) looks like a Mamba2 mixer but the recurrent ops "
                                                    r"do not reproduce its forward on a probe"):
        optimize(model, num_kv_blocks=8)


def test_recurrent_draft_model_is_refused(tiny_model):
    """A draft with recurrent layers would need its own states rolled back: refused naming the way out."""
    with pytest.raises(ValueError, match="the draft has recurrent layers.*method='ngram'"):
        optimize(tiny_model("llama", "eager"), num_kv_blocks=16,
                 speculative=dict(method="draft", model=tiny_model("bamba", "eager")))
