"""torch.compile(model, backend="devin"): registered by entry point, equal to eager.

The backend runs the graph-generic passes and hands the graph to Inductor, so this is
the one slow-ish Inductor compile of the suite (a tiny 2-layer model).
"""
import logging
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile.compile_backend as cb


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def test_backend_is_registered_by_name():
    from torch._dynamo import list_backends

    assert "devin" in list_backends(exclude_tags=())


def test_hf_generate_with_compiled_forward_equals_eager():
    model = _tiny()
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)
        logits_ref = model(ids).logits
    torch._dynamo.reset()
    before = len(cb.reports)
    compiled = torch.compile(model, backend="devin")
    with torch.no_grad():
        assert torch.allclose(compiled(ids).logits, logits_ref, atol=1e-5)
        model.forward = torch.compile(model.forward, backend="devin")
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    assert len(cb.reports) > before  # the backend really compiled graphs
    assert cb.reports[-1].records[0].name == "cleanup"


def test_unknown_option_is_rejected():
    model = _tiny()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="devin", options={"no_such_option": 1})
    with pytest.raises(Exception, match="unknown options"):
        compiled(torch.randint(0, 256, (1, 4)))


def test_backend_hands_passes_a_typed_config(monkeypatch, tmp_path):
    """The passes get an OptimizeConfig built from the backend's options (no Inductor compile here)."""
    import torch._inductor.compile_fx as inductor

    from devin_compile.config import OptimizeConfig
    from devin_compile.passes.cleanup import Cleanup

    seen = []
    run = Cleanup.run
    monkeypatch.setattr(Cleanup, "run", lambda self, program, ctx: seen.append(ctx) or run(self, program, ctx))
    monkeypatch.setattr(inductor, "compile_fx", lambda gm, example_inputs, config_patches: gm)
    gm = torch.fx.symbolic_trace(lambda x: (x + 1).to(torch.float32))
    cb.devin_backend(gm, [torch.ones(2)], options={"dump_dir": str(tmp_path), "inductor": {}})
    (ctx,) = seen
    assert isinstance(ctx.config, OptimizeConfig) and ctx.config.dump_dir == str(tmp_path) and ctx.info is None
    with pytest.raises(ValueError, match="unknown options"):
        cb.devin_backend(gm, [torch.ones(2)], options={"decode_buckets": (1,)})  # an optimize() key, not the backend's


def test_compile_model_compiles_once_for_every_prompt_length(caplog):
    """compile_model marks the token dimension dynamic before Dynamo's first trace: five prompt
    lengths, one backend compile (and one Dynamo graph), logits equal HF eager. Under generate the
    graphs the first prompt needs serve a prompt of another length too, and greedy output equals
    eager's. The first call's log says what was compiled and how long it took."""
    from torch._dynamo.utils import counters

    import devin_compile
    from devin_compile.dynamic_tokens import uncompile_model

    model = _tiny()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (1, n), generator=gen) for n in (11, 7, 19, 5, 30)]
    with torch.no_grad():
        refs = [model(ids).logits for ids in prompts]
        greedy = [model.generate(ids, max_new_tokens=6, do_sample=False) for ids in prompts[:2]]
    torch._dynamo.reset()
    before, graphs_before = len(cb.reports), counters["stats"]["unique_graphs"]
    assert devin_compile.compile_model(model) is model
    try:
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="devin_compile"):
            for ids, ref in zip(prompts, refs):
                assert torch.allclose(model(ids).logits, ref, atol=1e-5)
            assert len(cb.reports) - before == 1 and counters["stats"]["unique_graphs"] - graphs_before == 1
            assert torch.equal(model.generate(prompts[0], max_new_tokens=6, do_sample=False), greedy[0])
            after_first = len(cb.reports)  # + prefill with a cache, decode (twice: the cache's strides change)
            assert torch.equal(model.generate(prompts[1], max_new_tokens=6, do_sample=False), greedy[1])
            assert len(cb.reports) == after_first  # another prompt length: nothing compiled
    finally:
        uncompile_model(model)
    assert "forward" not in model.__dict__ and not model._forward_pre_hooks and not model._forward_hooks
    lines = [r.getMessage() for r in caplog.records]
    graph_lines = [m for m in lines if m.startswith("torch.compile backend 'devin': graph")]
    assert len(graph_lines) == after_first - before
    assert all("sizes symbolic in" in m and "cleanup ran" in m for m in graph_lines), graph_lines
    # what torch's own caches did is said too (hit or miss: the test suite shares one cache folder)
    assert all(re.search(r"Inductor FX-graph cache (hit|miss|\d+ hit, \d+ miss)", m) for m in graph_lines), graph_lines
    first = [m for m in lines if m.startswith("first call of the compiled LlamaForCausalLM: 1 graph(s) compiled in")]
    assert len(first) == 1, lines


def test_compile_model_refuses_another_backend():
    with pytest.raises(ValueError, match="always compiles with backend='devin'"):
        __import__("devin_compile").compile_model(_tiny(), backend="inductor")
