"""offload_embeddings pass and pipeline_offload: placement rewrites leave outputs unchanged."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile as dc
from devin_compile.api import make_probe
from devin_compile.capture import capture
from devin_compile.config import OptimizeConfig
from devin_compile.graph_utils import is_call
from devin_compile.passes import AttentionToPaged, Cleanup, OffloadEmbeddings, SplitPhases
from devin_compile.pipeline import PassContext, PassManager, Program


def tiny(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("roles", [{"embedding"}, {"lm_head"}, {"embedding", "lm_head"}])
def test_forced_rewrite_keeps_logits(tied, roles):
    """On this CPU-only machine the rewrite is forced (its device copies are CPU→CPU), so the
    graph surgery itself is checked: same logits, the expected transfers, tied weights once."""
    model = tiny(tied)
    results = {}
    for label, extra in (("plain", []), ("offload", [OffloadEmbeddings(roles, force=True)])):
        gm, info = capture(model)
        program = Program({"main": gm})
        ctx = PassContext(info=info, config=OptimizeConfig())
        report = PassManager([AttentionToPaged(), SplitPhases(), *extra, Cleanup()]).run(program, ctx)
        with torch.inference_mode():
            results[label] = make_probe(info, info.device)(program)
        if extra:
            rec = next(r for r in report.records if r.name == "offload_embeddings")
            assert rec.status == "ran" and rec.matches == 2 * len(roles)  # prefill and decode graphs
            table = 128 * 32 * 4
            n_tables = 1 if (tied or len(roles) == 1) else 2
            assert f"saved {n_tables * table / 2**20:.1f} MiB" in rec.note
            copies = sum(is_call(n, torch.ops.aten._to_copy.default) for n in program.graphs["decode"].graph.nodes)
            assert copies == 2 * len(roles)  # in and out, per module
    torch.testing.assert_close(results["offload"], results["plain"], rtol=0, atol=0)


def test_optimize_on_cpu_skips_with_reason_and_matches():
    model = tiny(True)
    ids = [[5, 6, 7, 8]]
    plain = dc.optimize(model, num_kv_blocks=32).generate(ids, max_new_tokens=5, ignore_eos=True)
    opt = dc.optimize(model, num_kv_blocks=32, offload_layers=["embed_tokens", "lm_head"])
    assert opt.generate(ids, max_new_tokens=5, ignore_eos=True) == plain
    assert "already on the CPU" in opt.report()


def test_unknown_module_names_are_listed():
    model = tiny(False)
    with pytest.raises(ValueError, match=r"no module named \['wte'\].*valid names: \['embed_tokens', 'lm_head'\]"):
        dc.optimize(model, offload_layers=["wte"])
    with pytest.raises(ValueError, match="valid names"):
        dc.pipeline_offload(model, offload_layers=["lm_heads"])


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_offload_eager_generate_unchanged(tied):
    model = tiny(tied)
    ids = torch.tensor([[3, 9, 27, 4]])
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    dc.pipeline_offload(model, offload_layers=["embed_tokens"])
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    moved = model._devin_offload
    assert "model.embed_tokens" in moved
    if tied:  # one shared tensor: the head comes along and is counted once
        assert "lm_head" in moved and moved["total_unique"] == 128 * 32 * 4
        assert model.lm_head.weight is model.model.embed_tokens.weight
