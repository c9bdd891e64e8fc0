"""The rewrite passes keep values: each pass alone vs the paged graph without it.

fuse_rotary and fuse_rms_norm are bit-identical in float32; fuse_projections is equal up
to float32 GEMM rounding; prepack_linear is bit-identical in bf16. Each pass must also
actually match (its count equals the number of sites in a 2-layer Llama).
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from devin_compile.api import make_probe
from devin_compile.capture import capture
from devin_compile.passes import AttentionToPaged, FuseProjections, FuseRMSNorm, FuseRotary, PrepackLinear
from devin_compile.pipeline import PassContext, PassManager, Program


def _model(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def _run(model, passes):
    gm, info = capture(model)
    program = Program({"main": gm})
    report = PassManager([AttentionToPaged(), *passes]).run(program, PassContext(info, None))
    with torch.no_grad():
        return make_probe(info, info.device)(program), report


@pytest.mark.parametrize("pass_cls,sites,exact", [
    (FuseRotary, 4, True),        # q and k in each of 2 layers
    (FuseRMSNorm, 5, True),       # 2 per layer + the final norm
    (FuseProjections, 4, False),  # q/k/v and gate/up per layer
])
def test_pass_keeps_values_fp32(pass_cls, sites, exact):
    model = _model(torch.float32)
    base, _ = _run(model, [])
    out, report = _run(model, [pass_cls()])
    assert report.records[-1].matches == sites
    if exact:
        assert torch.equal(out, base)
    else:
        assert (out - base).abs().max() <= 1e-5


def test_prepack_linear_bit_identical_bf16():
    model = _model(torch.bfloat16)
    base, _ = _run(model, [])
    out, report = _run(model, [PrepackLinear()])
    rec = report.records[-1]
    if rec.status == "skipped":
        pytest.skip(rec.note)
    assert rec.matches == 2 * 7 + 1  # 7 linears per layer + lm_head
    assert torch.equal(out, base)
