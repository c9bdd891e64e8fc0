"""MoE experts: ``devin::grouped_linear`` against transformers' own grouped GEMM, and the
prepack_experts rewrite in compiled graphs. Greedy parity of the MoE families (mixtral, qwen3_moe,
deepseek_v2/v3) with HF eager runs in test_families.py, through this pass (prepack_linear is on)."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import devin_compile.ops  # noqa: F401  (registers devin::grouped_linear)
from conftest import FAMILIES, build_model
from devin_compile import optimize
from devin_compile.ops.prepacked_linear import prepack_supported

transformers_moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
pytestmark = pytest.mark.skipif(not prepack_supported(torch.float32), reason="no oneDNN float32 linear here")


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=6), tail=st.integers(0, 3),
       k=st.sampled_from([8, 24]), n=st.sampled_from([16, 40]), seed=st.integers(0, 2**31 - 1))
def test_grouped_linear_equals_transformers_grouped_mm(counts, tail, k, n, seed):
    """Rows sorted by expert (some experts empty), plus ``tail`` rows past ``offs[-1]`` (zeros)."""
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    w = torch.randn(E, n, k, generator=g)  # HF layout [E, out, in]
    x = torch.randn(sum(counts) + tail, k, generator=g)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    want = torch.ops.transformers.grouped_mm_fallback(x, w.transpose(-2, -1), offs)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w[e].contiguous(), 4) for e in range(E)]
    got = torch.ops.devin.grouped_linear(x, offs, packed, n)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.all(got[sum(counts):] == 0)


def test_grouped_linear_checks_expert_count():
    with pytest.raises(ValueError, match="2 expert weights but 3 offsets"):
        torch.ops.devin.grouped_linear(torch.zeros(1, 4), torch.tensor([1, 1, 1]), [torch.zeros(2, 4)] * 2, 2)


def test_prepack_experts_rewrites_every_expert_gemm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fam = FAMILIES["mixtral"]
        model = build_model(fam.model_type, fam.config_kwargs(), "sdpa")
        opt = optimize(model, num_kv_blocks=16)
    for gm in opt.program.graphs.values():
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.devin.grouped_linear.default) == 2 * model.config.num_hidden_layers
        assert not any("grouped_mm_fallback" in str(t) for t in targets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ref = model(ids).logits[0]
    torch.testing.assert_close(opt(ids).logits[0], ref, atol=1e-4, rtol=1e-4)
