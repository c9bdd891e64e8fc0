"""split_phases: prefill/decode graphs, decode-bucket padding, fall-back above the largest bucket."""
from __future__ import annotations

import pytest
import torch

import devin_compile as dc
from devin_compile.graph_utils import is_call
from devin_compile.step import decode_bucket
from devin_compile.step import AttentionMetadata, StepContext, step_context
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache
from devin_compile.runtime.model_runner import ModelRunner

from test_engine import greedy, hf, make_engine, model, prompt_of  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def opt(model):  # noqa: F811
    return dc.optimize(model, num_kv_blocks=128, block_size=4, decode_buckets=(1, 2, 4, 8))


def test_program_has_both_phases_sharing_weights(opt):
    g = opt.program.graphs
    assert set(g) == {"prefill", "decode"}
    assert opt.program.decode_buckets == (1, 2, 4, 8)
    index = torch.ops.aten.index.Tensor
    assert sum(is_call(n, index) for n in g["prefill"].graph.nodes) == 1
    assert sum(is_call(n, index) for n in g["decode"].graph.nodes) == 0
    pre = {n.target: getattr(g["prefill"], n.target) for n in g["prefill"].graph.nodes if n.op == "get_attr"}
    dec = {n.target: getattr(g["decode"], n.target) for n in g["decode"].graph.nodes if n.op == "get_attr"}
    shared = set(pre) & set(dec)
    assert shared and all(pre[k] is dec[k] for k in shared)
    assert "split_phases" in opt.report()


def test_bucket_choice():
    assert [decode_bucket(b, (1, 2, 4, 8)) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_decode_graph_equals_prefill_graph_on_decode_steps(opt):
    """Three sequences with cached context, one new token each: both graphs, same cache → same logits."""
    info = opt.info
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, 4)
    cache = PagedKVCache(spec, 32, info.device)
    runner = ModelRunner(opt.program, cache, vocab_size=info.vocab_size, backend=opt.engine.runner.backend)
    lens = [5, 9, 2]
    tables = [[0, 1], [2, 3, 4], [5]]
    for i, (n, t) in enumerate(zip(lens, tables)):  # prefill each prompt into its blocks
        runner.run(prompt_of(n, i), list(range(n)), [t[p // 4] * 4 + p % 4 for p in range(n)], [n], [n], [t], [n - 1])
    ids = [7, 8, 9]
    slots = [t[n // 4] * 4 + n % 4 for n, t in zip(lens, tables)]
    meta = AttentionMetadata.build([1, 1, 1], [n + 1 for n in lens], tables, slots)
    args = (torch.tensor([ids]), torch.tensor([lens]), torch.arange(3))
    out = {}
    for phase in ("prefill", "decode"):
        c = PagedKVCache(spec, 32, info.device)
        for layer in range(info.num_layers):
            for dst, src in zip(c.layer(layer), cache.layer(layer)):
                dst.copy_(src)
        with torch.inference_mode(), step_context(StepContext(meta, c, runner.backend)):
            out[phase] = opt.program.graphs[phase](*args)
    torch.testing.assert_close(out["decode"], out["prefill"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [3, 5])
def test_padded_decode_matches_hf(opt, hf, batch):  # noqa: F811
    engine = make_engine(opt, num_blocks=96)
    engine.runner.pad_decode = True
    prompts = [prompt_of(3 + 4 * i, 100 + i) for i in range(batch)]
    outs = engine.generate(prompts, greedy(6))
    assert [o.output_ids for o in outs] == [hf(p, 6) for p in prompts]


def test_padded_slots_touch_no_kv_page(opt):
    """A decode step of 3 real sequences padded to 4: only the 3 real slots change in the pool."""
    info = opt.info
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, 4)
    cache = PagedKVCache(spec, 16, info.device)
    for layer in range(info.num_layers):
        for t in cache.layer(layer):
            t.normal_()
    runner = ModelRunner(opt.program, cache, vocab_size=info.vocab_size, backend=opt.engine.runner.backend)
    runner.pad_decode = True
    before = [t.clone() for layer in range(info.num_layers) for t in cache.layer(layer)]
    tables = [[0, 1], [2], [3, 4]]
    lens = [6, 3, 5]  # cached before this step
    slots = [t[n // 4] * 4 + n % 4 for n, t in zip(lens, tables)]
    logits = runner.run([5, 6, 7], lens, slots, [1, 1, 1], [n + 1 for n in lens], tables, [0, 1, 2])
    assert logits.shape[0] == 3
    after = [t for layer in range(info.num_layers) for t in cache.layer(layer)]
    for b, a in zip(before, after):
        changed = (b != a).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert changed == sorted(slots)


def test_above_largest_bucket_runs_unpadded(model, hf):  # noqa: F811
    small = dc.optimize(model, num_kv_blocks=128, block_size=4, decode_buckets=(1, 2))
    engine = make_engine(small, num_blocks=96)
    engine.runner.pad_decode = True
    prompts = [prompt_of(4 + i, 200 + i) for i in range(3)]
    outs = engine.generate(prompts, greedy(4))
    assert [o.output_ids for o in outs] == [hf(p, 4) for p in prompts]


def test_one_token_prompt_chunks_do_not_use_decode_graph():
    assert ModelRunner.is_decode_step([1, 1], [0, 1])
    assert not ModelRunner.is_decode_step([1, 1], [1])  # first sequence is mid-prompt: no logits for it
    assert not ModelRunner.is_decode_step([1, 3], [0, 3])


@pytest.mark.parametrize("bad", [(), (0, 2), ("4",), 8])
def test_bad_decode_buckets(model, bad):  # noqa: F811
    with pytest.raises(ValueError, match="decode_buckets"):
        dc.optimize(model, decode_buckets=bad)
