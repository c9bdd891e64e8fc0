"""torch.compile(model, backend="devin"): registered by entry point, equal to eager.

The backend runs the graph-generic passes and hands the graph to Inductor, so this is
the one slow-ish Inductor compile of the suite (a tiny 2-layer model).
"""
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
