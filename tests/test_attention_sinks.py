"""Attention sinks (gpt-oss): reading the per-head logits from the graph, the backends against the torch
reference, and the refusals.

A sink is a learned logit per head that joins each softmax's denominator and attends to nothing. The
family itself (teacher-forced logits, a padded batch, greedy parity with HF eager) runs in
test_families.py through ``conftest.FAMILIES["gpt_oss"]``; under preemption and chunked prefill in
test_recurrent_battery.py.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx
from hypothesis import HealthCheck, given, settings

from conftest import FAMILIES, build_model
from test_attention_backends import (TOLERANCES, Case, _fixed_case, _tensors, _triton_interpreter,  # noqa: F401
                                     c_kernel, cases, requires_triton)
from devin_compile import optimize
from devin_compile.backends.attention.kv_write import write_kv
from devin_compile.backends.attention.registry import get_backend
from devin_compile.backends.attention.torch_reference import reference_paged_attention
from devin_compile.passes.attention_to_paged.alibi import SubgraphEvaluator
from devin_compile.passes.attention_to_paged.sinks import fit_sinks
from devin_compile.pipeline import PassError

aten = torch.ops.aten


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _sinks(hq: int, seed: int) -> torch.Tensor:
    """Sink logits around the scores' scale, some large enough to take most of a row's mass."""
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2.0 + 1.0


# --------------------------------------------------------------------------- the reference


def test_reference_sinks_join_the_denominator():
    """Query 1 of sequence 0 by hand: ``exp(s_j) / (exp(sink_h) + Σ exp(s_k))``, rows summing below 1."""
    case = Case([3, 1], [7, 5], [[1, 2], [3, 4]], [9, 10, 11, 16], 5, 4, 1, 2, 8, seed=3)
    meta = case.meta()
    q, k, v, kc, vc = _tensors(case, torch.float32)
    write_kv(k, v, kc, vc, meta)
    sinks = torch.tensor([0.7, -1.5])
    out = reference_paged_attention(q, kc, vc, meta, scale=0.3, sinks=sinks)
    keys = torch.cat([kc[1], kc[2]])[:6, 0].float()
    vals = torch.cat([vc[1], vc[2]])[:6, 0].float()
    for h in range(2):
        s = keys @ q[1, h] * 0.3
        p = torch.exp(s) / (torch.exp(sinks[h]) + torch.exp(s).sum())
        torch.testing.assert_close(out[1, h], p @ vals)
    plain = reference_paged_attention(q, kc, vc, meta, scale=0.3)
    assert not torch.allclose(out, plain, atol=1e-3)


# --------------------------------------------------------------------------- backends vs the reference


def check_sinks(name: str, case: Case, dtype: torch.dtype = torch.float32, *, alibi: bool = False) -> None:
    backend = get_backend(name)
    Hq = case.num_kv_heads * case.group
    extra = dict(alibi=True) if alibi else {}
    assert backend.supports(dtype=dtype, head_dim=case.head_dim, softcap=case.softcap,
                            sliding_window=case.sliding_window, sinks=True, **extra)
    meta = case.meta()
    q, k, v, k_cache0, v_cache0 = _tensors(case, dtype)
    sinks = _sinks(Hq, case.seed)
    kw = dict(scale=case.head_dim ** -0.5, softcap=case.softcap, sliding_window=case.sliding_window)
    if alibi:
        kw["alibi_slopes"] = 2.0 ** -torch.arange(1, Hq + 1, dtype=torch.float32)
    k_ref, v_ref = k_cache0.clone(), v_cache0.clone()
    write_kv(k, v, k_ref, v_ref, meta)
    expected = reference_paged_attention(q, k_ref, v_ref, meta, sinks=sinks, **kw)
    k_out, v_out = k_cache0.clone(), v_cache0.clone()
    out = backend.forward(q, k, v, k_out, v_out, meta, sinks=sinks, **kw)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    real = torch.tensor([s >= 0 for s in case.slot_mapping])
    torch.testing.assert_close(out[real].float(), expected[real].float(), **TOLERANCES[dtype])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True))
def test_cpu_sdpa_sinks_match_reference(case: Case) -> None:
    check_sinks("cpu_sdpa", case)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True))
def test_cpu_sdpa_sinks_with_alibi(case: Case) -> None:
    check_sinks("cpu_sdpa", case, alibi=True)


@requires_triton
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(softcap=True, window=True))
def test_triton_sinks_match_reference(case: Case) -> None:
    check_sinks("triton", case)


@requires_triton
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True))
def test_triton_sinks_with_alibi(case: Case) -> None:
    check_sinks("triton", case, alibi=True)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_sinks_half_precision(dtype: torch.dtype) -> None:
    check_sinks("triton", _fixed_case(32, sliding_window=4), dtype)


def test_flash_attention_declines_sinks():
    """Neither FlashAttention's ``flash_attn_with_kvcache`` takes a sink logit: such calls go to the reference."""
    from devin_compile.backends.attention.flash_attn import FlashAttn2Backend, FlashAttn3Backend

    stand_in = lambda *a, **k: None  # noqa: E731  (supports() never calls it)
    for backend in (FlashAttn3Backend(fn=stand_in), FlashAttn2Backend(fn=stand_in)):
        kw = dict(dtype=torch.bfloat16, head_dim=64, softcap=0.0, sliding_window=-1, block_size=256)
        assert backend.supports(**kw)
        assert not backend.supports(**kw, sinks=True)


@c_kernel
def test_native_decode_kernel_hands_sink_calls_to_python():
    """In a pure-decode step on cpu_sdpa the C++ op kernel declines calls with sinks (the C decode kernel
    has none): they run on the masked SDPA path and match the reference."""
    from devin_compile.backends.attention import cpu_sdpa
    from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
    from devin_compile.step import AttentionMetadata, StepContext, step_context

    if not cpu_sdpa._load_native_path():
        pytest.skip("the C++ decode ops cannot be built here")
    gen = torch.Generator().manual_seed(1)
    spec = KVCacheSpec(1, 2, 16, torch.float32, 4)
    lens, tables = [5, 9], [[0, 1], [3, 4, 5]]
    slots = [tables[b][(n - 1) // 4] * 4 + (n - 1) % 4 for b, n in enumerate(lens)]
    q, k, v = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    sinks = _sinks(4, 5)
    init = torch.randn(PagedKVCache(spec, 6, torch.device("cpu")).data.shape, generator=gen)
    outs, served = {}, {}
    for name in ("torch_reference", "cpu_sdpa"):
        cache = PagedKVCache(spec, 6, torch.device("cpu"))
        cache.data.copy_(init)
        meta = AttentionMetadata.build([1, 1], lens, tables, slots)
        with torch.inference_mode(), step_context(StepContext(meta, cache, get_backend(name))):
            outs[name] = torch.ops.devin.paged_attention(q, k, v, 0, 0.25, 0.0, -1, None, sinks=sinks)
        served[name] = meta.scratch["native_decode_layers"]
    assert served["cpu_sdpa"] == 0
    torch.testing.assert_close(outs["cpu_sdpa"], outs["torch_reference"], **TOLERANCES[torch.float32])


# --------------------------------------------------------------------------- reading the sinks from the graph


def _graph(fn) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)


def _sink_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


def test_fit_sinks_reads_a_parameter_column():
    def f(input_ids, position_ids, logits_indices):
        return aten.expand.default(aten.view.default(torch.ones(4), [1, 4, 1, 1]), [1, 4, 7, 1])

    gm = _graph(f)
    got = fit_sinks(SubgraphEvaluator(gm, 7), _sink_node(gm), 4, "layer 0")
    assert got.dtype == torch.float32 and got.tolist() == [1.0] * 4


def test_fit_sinks_refuses_columns_that_depend_on_the_inputs():
    def by_position(input_ids, position_ids, logits_indices):
        return aten.expand.default(aten.view.default(aten._to_copy.default(position_ids, dtype=torch.float32),
                                                     [1, 1, -1, 1]), [1, 4, -1, 1])

    gm = _graph(by_position)
    with pytest.raises(PassError, match=r"layer 1: the extra softmax column \(attention sink\) depends on"):
        fit_sinks(SubgraphEvaluator(gm, 7), _sink_node(gm), 4, "layer 1")


def test_fit_sinks_refuses_wrong_head_counts():
    def three(input_ids, position_ids, logits_indices):
        return aten.expand.default(aten.view.default(torch.ones(3), [1, 3, 1, 1]), [1, 3, 7, 1])

    gm = _graph(three)
    with pytest.raises(PassError, match="3 attention sink logits, expected 4 query heads"):
        fit_sinks(SubgraphEvaluator(gm, 7), _sink_node(gm), 4, "layer 0")


# --------------------------------------------------------------------------- end to end


def _model(**overrides):
    fam = FAMILIES["gpt_oss"]
    return build_model(fam.model_type, {**fam.config_kwargs(), **overrides}, "eager")


def test_graph_carries_the_model_sinks():
    model = _model()
    opt = optimize(model, attention_backend="torch_reference", num_kv_blocks=16)
    assert "attention sinks on 2" in opt.report()
    for gm in opt.program.graphs.values():
        calls = [n for n in gm.graph.nodes if n.op == "call_function"
                 and n.target == torch.ops.devin.paged_attention.default]
        assert len(calls) == 2
        for i, n in enumerate(calls):
            got = getattr(gm, n.kwargs["sinks"].target)
            torch.testing.assert_close(got, model.model.layers[i].self_attn.sinks.detach().float())


def test_kv_pruning_is_refused_for_sinks():
    model = _model(layer_types=["full_attention", "full_attention"])
    with pytest.raises(PassError, match=r"layer 0 has attention sinks.*drop kv_prune="):
        optimize(model, attention_backend="torch_reference", num_kv_blocks=16,
                 kv_prune=dict(threshold=0.0, step_interval=2, sink_tokens=2, recent_tokens=4, max_tokens=20))
