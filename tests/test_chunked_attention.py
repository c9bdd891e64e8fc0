"""Chunked local attention (Llama 4's rotary layers): the mask probe, the backends against the torch
reference (FlashAttention through test_flash_attn_adapter's stand-ins), positions computed from
``arange`` over the step, and the refusals.

The query at position p sees only the keys of its own fixed-size chunk, ``[floor(p / C)·C, p]``. The
family itself (teacher-forced logits, a padded batch, greedy parity with HF eager, SDPA and eager
attention) runs in test_families.py through ``conftest.FAMILIES["llama4_text"]`` (chunk 8 on its
rotary layer beside a NoPE global layer whose attention temperature tuning is made to matter with
``floor_scale=4``); under preemption and chunked prefill in test_recurrent_battery.py.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FAMILIES, build_model
from test_attention_backends import (TOLERANCES, Case, _fixed_case, _tensors, _triton_interpreter,  # noqa: F401
                                     _without_c_kernel, c_kernel, cases, requires_triton)
from test_flash_attn_adapter import batch_specs, make_fa2_stand_in, make_fa3_stand_in, run_against_reference
from devin_compile import optimize
from devin_compile.backends.attention.flash_attn import FlashAttn2Backend, FlashAttn3Backend
from devin_compile.backends.attention.kv_write import write_kv
from devin_compile.backends.attention.registry import get_backend
from devin_compile.backends.attention.torch_reference import reference_paged_attention, visible_mask
from devin_compile.capture import UnsupportedModelError, model_info, module_path_of
from devin_compile.capture.mask_probe import MaskShape, _shape_of
from devin_compile.pipeline import PassError

CHUNKS = st.sampled_from([1, 2, 3, 5, 8, 16])


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- the mask probe


def test_visible_mask_chunks():
    """Query i of a 3-query step over 10 slots sits at slot 7 + i; chunk 4: slots 4.. for 7, 8.. for 8, 9."""
    got = visible_mask(3, 10, -1, torch.device("cpu"), attention_chunk=4)
    want = torch.zeros(3, 10, dtype=torch.bool)
    want[0, 4:8], want[1, 8:9], want[2, 8:10] = True, True, True
    assert torch.equal(got, want)
    both = visible_mask(3, 10, 2, torch.device("cpu"), attention_chunk=4)  # window 2 inside the chunk
    assert both[0].nonzero().flatten().tolist() == [6, 7] and both[1].nonzero().flatten().tolist() == [8]


def test_probe_reads_chunks_and_refuses_other_masks():
    model = torch.nn.Linear(1, 1)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    chunked = (j <= i) & (j >= i // 3 * 3)
    widths = MaskShape(window=-1, chunk=8192)
    assert _shape_of(model, "a", model, chunked, None, -1, widths) == MaskShape(chunk=8192)
    assert _shape_of(model, "a", model, (j <= i) & (j > i - 2), None, -1, MaskShape(window=12)) == MaskShape(window=12)
    with pytest.raises(UnsupportedModelError, match="a: the attention mask .* neither causal"):
        _shape_of(model, "a", model, chunked, None, -1, MaskShape())  # chunked, but no config width to read
    with pytest.raises(UnsupportedModelError, match="neither causal"):
        _shape_of(model, "a", model, (j <= i) & (j >= i // 2 * 2), None, -1, widths)  # chunks of another size


def test_model_info_reads_llama4_chunks():
    fam = FAMILIES["llama4_text"]
    info = model_info(build_model(fam.model_type, fam.config_kwargs(), "sdpa"))
    assert info.attention_chunks == {info.attention_modules[0]: 8}
    assert all(info.sliding_windows[m] == -1 for m in info.attention_modules)


# --------------------------------------------------------------------------- backends vs the reference


def check_chunk(name: str, case: Case, chunk: int, dtype: torch.dtype = torch.float32) -> None:
    backend = get_backend(name)
    assert backend.supports(dtype=dtype, head_dim=case.head_dim, softcap=case.softcap,
                            sliding_window=case.sliding_window, attention_chunk=chunk)
    meta = case.meta()
    q, k, v, k_cache0, v_cache0 = _tensors(case, dtype)
    kw = dict(scale=case.head_dim ** -0.5, softcap=case.softcap, sliding_window=case.sliding_window)
    k_ref, v_ref = k_cache0.clone(), v_cache0.clone()
    write_kv(k, v, k_ref, v_ref, meta)
    expected = reference_paged_attention(q, k_ref, v_ref, meta, attention_chunk=chunk, **kw)
    k_out, v_out = k_cache0.clone(), v_cache0.clone()
    out = backend.forward(q, k, v, k_out, v_out, meta, attention_chunk=chunk, **kw)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    real = torch.tensor([s >= 0 for s in case.slot_mapping])
    torch.testing.assert_close(out[real].float(), expected[real].float(), **TOLERANCES[dtype])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True), chunk=CHUNKS)
def test_cpu_sdpa_chunks_match_reference(case: Case, chunk: int) -> None:
    check_chunk("cpu_sdpa", case, chunk)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), chunk=CHUNKS)
def test_cpu_sdpa_torch_paths_chunks_match_reference(case: Case, chunk: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _without_c_kernel(mp)
        check_chunk("cpu_sdpa", case, chunk)


@requires_triton
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(softcap=True, window=True), chunk=CHUNKS)
def test_triton_chunks_match_reference(case: Case, chunk: int) -> None:
    check_chunk("triton", case, chunk)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_chunks_half_precision(dtype: torch.dtype) -> None:
    check_chunk("triton", _fixed_case(32), 4, dtype)


@requires_triton
@pytest.mark.parametrize("chunk", [16, 40, 64])
def test_triton_long_context_chunks(chunk: int) -> None:
    """Long sequences, so the chunk's start skips whole kv tiles (the loop's lower bound moves), with
    a chunk of 7 queries that crosses a chunk boundary when the chunk is 16."""
    bs = 16
    tables = [list(range(17, 8, -1)), [3, 1, 8, 5, 2, 7, 4]]  # seq 0: kv 130 decode; seq 1: 7 queries over 90
    query_lens, seq_lens, ctx = [1, 7], [130, 97], [129, 90]
    slots = []
    for table, kv_len, c in zip(tables, seq_lens, ctx):
        slots += [table[p // bs] * bs + p % bs for p in range(c, kv_len)]
    case = Case(query_lens, seq_lens, tables, slots, num_blocks=18, block_size=bs, num_kv_heads=1, group=3,
                head_dim=16, seed=7)
    check_chunk("triton", case, chunk)
    check_chunk("cpu_sdpa", case, chunk)


@c_kernel
def test_native_decode_kernel_hands_chunked_calls_to_python():
    """In a pure-decode step on cpu_sdpa the C++ op kernel declines chunked calls (the C decode kernel
    attends to every cached slot): the Python kernel serves them, matching the reference."""
    from devin_compile.backends.attention import cpu_sdpa
    from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
    from devin_compile.step import AttentionMetadata, StepContext, step_context

    if not cpu_sdpa._load_native_path():
        pytest.skip("the C++ decode ops cannot be built here")
    gen = torch.Generator().manual_seed(2)
    spec = KVCacheSpec(1, 2, 16, torch.float32, 4)
    lens, tables = [5, 11], [[0, 1], [3, 4, 5]]
    slots = [tables[b][(n - 1) // 4] * 4 + (n - 1) % 4 for b, n in enumerate(lens)]
    q, k, v = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    init = torch.randn(PagedKVCache(spec, 6, torch.device("cpu")).data.shape, generator=gen)
    outs, served = {}, {}
    for name in ("torch_reference", "cpu_sdpa"):
        cache = PagedKVCache(spec, 6, torch.device("cpu"))
        cache.data.copy_(init)
        meta = AttentionMetadata.build([1, 1], lens, tables, slots)
        with torch.inference_mode(), step_context(StepContext(meta, cache, get_backend(name))):
            outs[name] = torch.ops.devin.paged_attention(q, k, v, 0, 0.25, attention_chunk=4)
        served[name] = meta.scratch["native_decode_layers"]
    assert served["cpu_sdpa"] == 0
    torch.testing.assert_close(outs["cpu_sdpa"], outs["torch_reference"], **TOLERANCES[torch.float32])


# --------------------------------------------------------------------------- FlashAttention (stand-ins)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_specs(block_sizes=[1, 5, 16], max_ctx=40, max_q=12, head_dims=[8, 32]), st.sampled_from([1, 3, 8, 16]))
def test_fa3_adapter_chunked_attention_matches_reference(spec, chunk):
    """Chunked attention reaches FA3's ``attention_chunk`` and gives the reference's chunks."""
    stand_in = make_fa3_stand_in()
    backend = FlashAttn3Backend(fn=stand_in)
    assert backend.supports(dtype=torch.float16, head_dim=32, softcap=0.0, sliding_window=-1, attention_chunk=chunk)
    run_against_reference(backend, dict(spec, chunk=chunk))
    assert stand_in.calls[0]["chunk"] == chunk


def test_declines_chunked_attention_and_sinks_without_library_support():
    """FA2's ``flash_attn_with_kvcache`` has no attention chunk and no sink, nor has an FA3 build whose
    signature lacks ``attention_chunk``; FA3's has no sink: such calls are declined (the reference runs them)."""
    kw = dict(dtype=torch.float16, head_dim=32, softcap=0.0, sliding_window=-1, block_size=256)
    fa2 = FlashAttn2Backend(fn=make_fa2_stand_in())
    old_fa3 = FlashAttn3Backend(fn=make_fa3_stand_in(with_varlen=False))
    for backend in (fa2, old_fa3):
        assert backend.supports(**kw)
        assert not backend.supports(**kw, attention_chunk=8)
        assert not backend.supports(**kw, sinks=True)
    assert not FlashAttn3Backend(fn=make_fa3_stand_in()).supports(**kw, sinks=True)


# --------------------------------------------------------------------------- the compiled model


@pytest.fixture(scope="module")
def llama4():
    fam = FAMILIES["llama4_text"]
    model = build_model(fam.model_type, fam.config_kwargs(), "sdpa")
    return model, optimize(model, attention_backend="torch_reference", num_kv_blocks=16)


def test_graph_carries_chunks_and_positions(llama4):
    """Layer 0 (rotary) gets ``attention_chunk=8``, layer 1 (NoPE) none; the NoPE layer's temperature
    tuning reads ``position_ids`` instead of ``arange`` over the step's tokens."""
    model, opt = llama4
    assert "chunked attention on 1" in opt.report() and "positions from position_ids in 1" in opt.report()
    for gm in opt.program.graphs.values():
        calls = [n for n in gm.graph.nodes if n.op == "call_function"
                 and n.target == torch.ops.devin.paged_attention.default]
        assert [n.kwargs.get("attention_chunk", -1) for n in calls] == [8, -1]
        aranges = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.arange.default
                   and module_path_of(n, among=opt.info.attention_modules) is not None]
        assert not aranges


def test_kv_pruning_is_refused_for_chunked_layers(llama4):
    model, _ = llama4
    with pytest.raises(PassError, match=r"layer 0 uses chunked attention.*drop kv_prune="):
        optimize(model, attention_backend="torch_reference", num_kv_blocks=16,
                 kv_prune=dict(threshold=0.0, step_interval=2, sink_tokens=2, recent_tokens=4, max_tokens=20))
