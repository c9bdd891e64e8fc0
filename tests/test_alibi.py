"""ALiBi: slope fitting in attention_to_paged, the backends against the torch reference, and the
runtime paths the family tests do not cover (prefix caching, chunked prefill, KV-pruning refusal).

The families themselves (bloom, mpt, falcon with ``alibi=True``: teacher-forced logits, a padded
batch of 5/19/37-token rows and greedy parity with HF eager) run in test_families.py through
``conftest.FAMILIES``.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import FAMILIES, build_model
from test_attention_backends import (TOLERANCES, Case, _tensors, _triton_interpreter, cases,  # noqa: F401
                                     requires_triton)
from devin_compile import optimize
from devin_compile.backends.attention.kv_write import write_kv
from devin_compile.backends.attention.registry import get_backend
from devin_compile.backends.attention.torch_reference import reference_paged_attention
from devin_compile.passes.attention_to_paged.alibi import fit_alibi
from devin_compile.pipeline import PassError


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- slope fitting


def _bias(slopes, P, *, row_shift=None, mask=True):
    i = torch.arange(P)[:, None]
    j = torch.arange(P)[None, :]
    b = torch.tensor(slopes, dtype=torch.float64)[:, None, None] * j.double()  # BLOOM style: slope * key position
    if row_shift is not None:
        b = b + row_shift[None, :, None]
    if mask:
        b = b.masked_fill(j > i, torch.finfo(torch.float32).min)
    return b


def test_fit_alibi_reads_slopes_and_ignores_row_constants():
    slopes = [0.5, 0.25, 0.125, 0.0625]
    got = fit_alibi(_bias(slopes, 16, row_shift=torch.randn(16).double()), 4, "layer")
    torch.testing.assert_close(got, torch.tensor(slopes), rtol=1e-6, atol=1e-7)


def test_fit_alibi_plain_mask_is_none():
    assert fit_alibi(_bias([0.0], 8), 4, "layer") is None
    assert fit_alibi(torch.zeros(1, 8, 8, dtype=torch.float64), 4, "layer") is None


def test_fit_alibi_one_slope_broadcasts_to_heads():
    assert fit_alibi(_bias([0.3], 8), 3, "layer").tolist() == pytest.approx([0.3] * 3)


def test_fit_alibi_refuses_other_biases():
    P = 12
    rel = (torch.arange(P)[None, :] - torch.arange(P)[:, None]).double()
    bucketed = -torch.log1p(rel.abs())[None]  # a log-bucket-like relative bias (T5 style): not linear
    with pytest.raises(PassError, match=r"layer 3: an additive attention bias that is neither a mask nor ALiBi"):
        fit_alibi(bucketed, 1, "layer 3")
    with pytest.raises(PassError, match="expected 4 query heads"):
        fit_alibi(_bias([0.5, 0.25], 8), 4, "layer")


# --------------------------------------------------------------------------- backends vs the reference


def check_alibi(name: str, case: Case, dtype: torch.dtype = torch.float32) -> None:
    backend = get_backend(name)
    Hq = case.num_kv_heads * case.group
    assert backend.supports(dtype=dtype, head_dim=case.head_dim, softcap=case.softcap,
                            sliding_window=case.sliding_window, alibi=True)
    meta = case.meta()
    q, k, v, k_cache0, v_cache0 = _tensors(case, dtype)
    slopes = 2.0 ** -torch.arange(1, Hq + 1, dtype=torch.float32)  # steep enough to dominate q·k
    scale = case.head_dim ** -0.5
    k_ref, v_ref = k_cache0.clone(), v_cache0.clone()
    write_kv(k, v, k_ref, v_ref, meta)
    kw = dict(scale=scale, softcap=case.softcap, sliding_window=case.sliding_window)
    expected = reference_paged_attention(q, k_ref, v_ref, meta, alibi_slopes=slopes, **kw)
    plain = reference_paged_attention(q, k_ref, v_ref, meta, **kw)
    k_out, v_out = k_cache0.clone(), v_cache0.clone()
    out = backend.forward(q, k, v, k_out, v_out, meta, alibi_slopes=slopes, **kw)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    real = torch.tensor([s >= 0 for s in case.slot_mapping])
    torch.testing.assert_close(out[real].float(), expected[real].float(), **TOLERANCES[dtype])
    # the bias is really applied: wherever a query sees more than one key, the output moves
    if any(L > 1 for L in meta.seq_lens_host) and case.sliding_window != 1:
        assert not torch.allclose(expected[real], plain[real], atol=1e-3)


def test_reference_alibi_equals_dense_bias():
    """The reference's bias is slope·(key − query) with query i at slot kv_len − q_len + i."""
    case = Case([3, 1], [7, 5], [[1, 2], [3, 4]], [9, 10, 11, 16], 5, 4, 1, 2, 8, seed=3)
    meta = case.meta()
    q, k, v, kc, vc = _tensors(case, torch.float32)
    write_kv(k, v, kc, vc, meta)
    slopes = torch.tensor([0.5, 0.125])
    out = reference_paged_attention(q, kc, vc, meta, scale=0.3, alibi_slopes=slopes)
    # sequence 0, query 1 (slot 5 of 7) by hand
    keys = torch.cat([kc[1], kc[2]])[:6, 0].float()
    vals = torch.cat([vc[1], vc[2]])[:6, 0].float()
    for h in range(2):
        s = keys @ q[1, h] * 0.3 + slopes[h] * (torch.arange(6) - 5)
        torch.testing.assert_close(out[1, h], torch.softmax(s, 0) @ vals)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True))
def test_cpu_sdpa_alibi_matches_reference(case: Case) -> None:
    check_alibi("cpu_sdpa", case)


@requires_triton
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(softcap=True, window=True))
def test_triton_alibi_matches_reference(case: Case) -> None:
    check_alibi("triton", case)


@requires_triton
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_triton_alibi_bf16(case: Case) -> None:
    check_alibi("triton", case, torch.bfloat16)


# --------------------------------------------------------------------------- end to end


def _prompts(lens, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _model(family):
    fam = FAMILIES[family]
    return build_model(fam.model_type, fam.config_kwargs(), fam.impls[-1])


@pytest.mark.parametrize("family, backend", [("bloom", None), ("mpt", "torch_reference")])
def test_alibi_prefix_caching_and_chunked_prefill_match_hf(family, backend):
    """Two waves sharing a 13-token preamble (the second wave reuses cached blocks, so its first
    query sits at a slot > 0), prefilled in 8-token chunks over cached context, block_size 4."""
    model = _model(family)
    opt = optimize(model, attention_backend=backend, block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    pre = _prompts([13], seed=5)[0]
    first = [pre + t for t in _prompts([3, 9], seed=6)]
    second = [pre + t for t in _prompts([1, 6, 11], seed=7)]
    assert opt.generate(first, max_new_tokens=12, ignore_eos=True) == [_hf_greedy(model, p, 12) for p in first]
    hits_before = opt.engine.kv_stats()["prefix_hit_tokens"]
    got = opt.generate(second, max_new_tokens=[10, 14, 8], ignore_eos=True)
    assert got == [_hf_greedy(model, p, n) for p, n in zip(second, [10, 14, 8])]
    assert opt.engine.kv_stats()["prefix_hit_tokens"] >= hits_before + 3 * 12  # 3 full blocks of the preamble each


def test_alibi_graph_carries_slopes():
    model = _model("bloom")
    opt = optimize(model, attention_backend="torch_reference", num_kv_blocks=16)
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    want = _get_alibi_slopes(model.config.n_head, torch.device("cpu")) * (1.0 / math.sqrt(1.0))
    for gm in opt.program.graphs.values():
        calls = [n for n in gm.graph.nodes if n.op == "call_function"
                 and n.target == torch.ops.devin.paged_attention.default]
        assert len(calls) == opt.info.num_layers
        for n in calls:
            slopes = getattr(gm, n.args[7].target)
            torch.testing.assert_close(slopes, want, rtol=1e-5, atol=1e-7)


def test_alibi_with_kv_pruning_is_refused():
    with pytest.raises(PassError, match=r"uses ALiBi.*drop kv_prune="):
        optimize(_model("bloom"), attention_backend="torch_reference", num_kv_blocks=16,
                 kv_prune=dict(threshold=0.0, step_interval=2, sink_tokens=2, recent_tokens=4, max_tokens=20))
