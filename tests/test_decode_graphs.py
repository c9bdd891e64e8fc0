"""Decode steps by bucket (runtime/decode_graphs.py) and the wrap_cuda_graphs pass, on CPU.

What a CUDA Graph replays is the decode graph run on one bucket's static buffers with static-maximum
host fields; ``static`` mode runs exactly that eagerly, so the buffers, the padding, the metadata a
captured step sees and the recompute rule are tested here with the Triton backend under the
interpreter (the backend a captured step uses on a GPU). The capture itself needs a GPU
(bench/gpu_check.py). Oracle: HF eager greedy tokens (fp32).
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import devin_compile as dc
from devin_compile.backends.attention.kv_write import write_kv
from devin_compile.backends.attention.registry import get_backend
from devin_compile.config import SchedulerConfig
from devin_compile.passes import WrapCudaGraphs
from devin_compile.passes.wrap_cuda_graphs import capture_blockers
from devin_compile.pipeline import PassContext
from devin_compile.runtime.decode_graphs import DecodeGraphs, StaticDecodeInputs
from devin_compile.runtime.engine import Engine
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
from devin_compile.runtime.model_runner import ModelRunner
from devin_compile.runtime.sampler import NON_FINITE, sample_rows
from devin_compile.step import AttentionMetadata, reachable_buckets
from test_engine import greedy, hf, make_engine, model, prompt_of  # noqa: F401  (fixtures)



def _interpreter_runs_paged_attention() -> bool:
    """Whether this Triton's interpreter runs the paged-attention kernel (Triton 3.6's cannot run its
    loop over a tensor-valued range; the compiled kernel on a GPU can)."""
    if importlib.util.find_spec("triton") is None:
        return False
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        meta = AttentionMetadata.build([1], [1], [[0]], [0])
        kc = torch.zeros(1, 4, 1, 8)
        try:
            get_backend("triton").forward(torch.ones(1, 1, 8), torch.ones(1, 1, 8), torch.ones(1, 1, 8), kc,
                                          kc.clone(), meta, scale=1.0, softcap=0.0, sliding_window=-1)
        except Exception:  # noqa: BLE001  (an interpreter that cannot run the kernel: the tests skip)
            return False
    return True


needs_triton = pytest.mark.skipif(not _interpreter_runs_paged_attention(),
                                  reason="needs a Triton whose interpreter runs the paged-attention kernel")
BUCKETS = (1, 2, 4)


@pytest.fixture(autouse=True)
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(scope="module")
def opt(model):  # noqa: F811
    return dc.optimize(model, num_kv_blocks=128, block_size=4, decode_buckets=BUCKETS)


def static_engine(opt, num_blocks: int = 96, backend: str = "triton", **sched) -> Engine:
    """An engine whose decode steps run in ``static`` mode (what a CUDA Graph replays) over ``backend``."""
    info = opt.info
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, 4)
    pool = PagedKVCache(spec, num_blocks, info.device)
    program = dataclasses.replace(opt.program, cuda_graph_buckets=BUCKETS)
    runner = ModelRunner(program, pool, vocab_size=info.vocab_size, backend=get_backend(backend), device=info.device)
    runner.decode_graphs = DecodeGraphs(program, pool, runner.backend, info.device, mode="static",
                                        max_seq_len=info.max_model_len)
    return Engine(runner, SchedulerConfig(**sched), max_model_len=info.max_model_len,
                  eos_token_ids=info.eos_token_ids)


@needs_triton
@pytest.mark.parametrize("batch", [1, 3, 6])  # 3 pads to bucket 4; 6 is above the largest bucket
def test_static_decode_steps_equal_hf(opt, hf, batch):  # noqa: F811
    engine = static_engine(opt)
    graphs = engine.runner.decode_graphs
    addresses = {b: (i.i64.data_ptr(), i.i32.data_ptr()) for b, i in graphs.inputs.items()}
    prompts = [prompt_of(3 + 5 * i, 900 + i) for i in range(batch)]
    outs = engine.generate(prompts, greedy(6))
    assert [o.output_ids for o in outs] == [hf(p, 6) for p in prompts]
    if batch <= max(BUCKETS):
        assert graphs.steps >= 5  # every decode step went through the bucket's buffers
    else:
        assert graphs.steps == 0  # above the largest bucket: the uncaptured decode graph
    assert {b: (i.i64.data_ptr(), i.i32.data_ptr()) for b, i in graphs.inputs.items()} == addresses
    assert engine.kv_stats()["blocks_used"] == 0


@needs_triton
def test_static_decode_with_speculative_verify_rows(model, hf):  # noqa: F811
    """ngram proposals make verify steps of 1 + k rows per sequence: decode rows, run by bucket."""
    spec = dc.optimize(model, num_kv_blocks=128, block_size=4, decode_buckets=(1, 2, 4, 8),
                       speculative={"method": "ngram", "num_tokens": 3, "adaptive": False})
    engine = static_engine(spec)
    engine.spec = spec.engine.spec
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats, so the n-gram lookup proposes
    out = engine.generate([prompt], greedy(8))[0]
    assert out.output_ids == hf(prompt, 8)
    assert engine.runner.decode_graphs.steps > 0
    assert engine.spec_stats()["drafted"] > 0


def test_fill_pads_rows_and_keeps_the_static_metadata():
    inp = StaticDecodeInputs(bucket=4, width=5, max_seq_len=20, device=torch.device("cpu"))
    inp.fill([9, 8, 7, 6], [4, 5, 6, 7], [1, 2, 3, 4], [5, 6, 7, 8], [[3, 4, 5, 6], [1], [2, 0, 1], [4]])
    inp.fill([11, 12], [3, 9], [17, 6], [4, 10], [[4], [1, 2, 3]])  # a narrower step after a wider one
    meta = inp.metadata()
    assert inp.ids.tolist() == [[11, 12, 0, 0]] and inp.positions.tolist() == [[3, 9, 0, 0]]
    assert meta.slot_mapping.tolist() == [17, 6, -1, -1]  # dummy rows write nothing
    assert meta.seq_lens.tolist() == [4, 10, 1, 1] and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_tables[:, :3].tolist() == [[4, 0, 0], [1, 2, 3], [0, 0, 0], [0, 0, 0]]
    assert meta.block_tables[0, 3] == 6  # past the step's widest table: stale, and never read
    assert meta.block_tables.shape == (4, 5)  # static width: a captured grid never depends on a step
    assert (meta.max_query_len, meta.max_seq_len, meta.seq_lens_host) == (1, 20, [20] * 4)
    assert meta.has_padded_slots and meta.scratch == {} and inp.metadata().scratch is not meta.scratch
    assert not inp.fits([[1] * 6]) and inp.fits([[1] * 5])


@needs_triton
def test_wider_block_table_and_pruning_steps_run_uncaptured(opt):
    engine = static_engine(opt)
    graphs = engine.runner.decode_graphs
    wide = [list(range(graphs.inputs[1].width + 1))]
    assert graphs.run([5], [3], [7], [4], wide) is None
    assert graphs.run([5] * 5, [3] * 5, [7] * 5, [4] * 5, [[1]] * 5) is None  # above the largest bucket
    assert graphs.steps == 0


@needs_triton
def test_non_finite_replay_is_recomputed_uncaptured(opt):
    engine = static_engine(opt)
    graphs = engine.runner.decode_graphs
    inp = graphs.inputs[2]
    inp.fill([5, 6], [0, 0], [0, 4], [1, 1], [[0], [1]])
    good = graphs._eager(inp)[0, :2]
    bad = good.clone()
    bad[1, 3] = float("nan")
    torch.testing.assert_close(graphs.recompute_if_not_finite(bad, inp), good)
    assert graphs.recomputes == 1
    torch.testing.assert_close(graphs.recompute_if_not_finite(good, inp), good)
    assert graphs.recomputes == 1  # finite logits are kept as they are
    graphs.recompute_depth = 0
    assert torch.isnan(graphs.recompute_if_not_finite(bad, inp)).any()  # depth 0: the sampler fails the row


def test_non_finite_row_fails_its_request_alone(opt, hf):  # noqa: F811
    engine = make_engine(opt, num_blocks=96)
    runner = engine.runner
    execute = runner.execute
    poisoned = set()

    def execute_with_nan(batch, kv_prune=None):
        logits, owners = execute(batch, kv_prune)
        logits = logits.clone()
        for row, i in enumerate(owners):
            if batch[i].seq.request_id in poisoned and batch[i].seq.output_ids:
                logits[row, 0] = float("inf")
        return logits, owners

    runner.execute = execute_with_nan
    a, b = prompt_of(5, 1), prompt_of(7, 2)
    ra = engine.add_request(a, greedy(5))
    rb = engine.add_request(b, greedy(5))
    poisoned.add(ra)
    while engine.has_unfinished():
        engine.step()
    out_a, out_b = engine.requests[ra], engine.requests[rb]
    assert out_a.status.name == "FAILED" and "NaN/inf" in out_a.error and len(out_a.output_ids) == 1
    assert out_b.output_ids == hf(b, 5)
    rows = sample_rows(torch.tensor([[0.0, float("nan")], [1.0, 0.0]]), [out_b, out_b])
    assert rows.errors == {0: NON_FINITE} and rows.tokens == [None, 0]


def test_write_kv_skips_padded_rows_without_a_host_sync():
    kc = torch.randn(4, 2, 1, 3)
    vc = torch.randn(4, 2, 1, 3)
    k, v = torch.randn(4, 1, 3), torch.randn(4, 1, 3)
    meta = AttentionMetadata.build([1] * 4, [1] * 4, [[0]] * 4, [5, -1, 0, -1])
    before_k, before_v = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, meta)
    want_k, want_v = before_k.view(8, 1, 3).clone(), before_v.view(8, 1, 3).clone()
    want_k[5], want_k[0], want_v[5], want_v[0] = k[0], k[2], v[0], v[2]
    assert torch.equal(kc.view(8, 1, 3), want_k) and torch.equal(vc.view(8, 1, 3), want_v)


def test_capture_blockers_name_host_syncs_value_shapes_and_other_devices(opt):
    decode = opt.program.graphs["decode"]
    assert capture_blockers(decode, torch.device("cpu")) == []
    on_cuda = capture_blockers(decode, torch.device("cuda"))
    assert on_cuda and "a value on cpu inside a cuda step" in on_cuda[0]
    gm = make_fx(lambda x: x[x > 0].sum() + x.nonzero().shape[0], tracing_mode="symbolic")(torch.randn(8))
    found = " | ".join(capture_blockers(gm, torch.device("cpu"), limit=5))
    assert "aten.nonzero reads tensor values on the host" in found
    assert "its shape depends on tensor values" in found


def test_wrap_cuda_graphs_is_skipped_on_cpu_and_declines_a_graph_it_cannot_capture(opt):
    row = next(line for line in opt.report().splitlines() if "| wrap_cuda_graphs |" in line)
    assert "CUDA only" in row
    program = dataclasses.replace(opt.program)
    ctx = PassContext(dataclasses.replace(opt.info, device=torch.device("cuda")))
    result = WrapCudaGraphs(max_rows=8).run(program, ctx)
    assert result.matches == 0 and "decode not captured" in result.note and "cpu inside a cuda step" in result.note
    assert program.cuda_graph_buckets == ()


def test_reachable_buckets_cover_every_step_size():
    assert reachable_buckets((1, 2, 4, 8, 16), 4) == (1, 2, 4)
    assert reachable_buckets((1, 2, 4, 8, 16), 5) == (1, 2, 4, 8)
    assert reachable_buckets((1, 2, 4), 64) == (1, 2, 4)
