"""MoE experts on CPU.

- ``devin::moe_experts``: its torch reference against transformers' own
  ``grouped_mm_experts_forward`` (the oracle is HF's math), and its C++ kernel against the reference
  (hypothesis: token counts, k, expert counts, ids that select nothing); ``devin::packed_gemm_linear``'s
  kernel against its reference;
- ``fuse_moe_experts`` on the MoE families (Mixtral; Qwen2-MoE with its shared expert and gate;
  Qwen3-MoE with and without ``norm_topk_prob``; OLMoE top-4 of 8; DeepSeek-V3's sigmoid group
  router): one op per MoE layer, no expert GEMM left, teacher-forced logits within 1e-4 of HF eager
  and greedy tokens identical to HF eager for a batch of prompts of different lengths; experts it
  cannot serve are declined with the reason in the report and stay on ``prepack_onednn_experts``;
- ``devin::grouped_linear`` / ``prepack_onednn_experts`` (the path declined experts take).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import devin_compile.ops  # noqa: F401  (registers the devin:: ops)
from conftest import FAMILIES, build_model
from devin_compile import optimize
from devin_compile.ops import moe_experts as moe_op
from devin_compile.ops import packed_gemm_linear as packed_op
from devin_compile.ops.onednn_linear import onednn_supports

transformers_moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
ATOL = 1e-4

needs_moe_kernel = pytest.mark.skipif(not moe_op.load_cpu_kernel(), reason="no C/C++ compiler for the MoE kernel")
needs_onednn = pytest.mark.skipif(not onednn_supports(torch.float32), reason="no oneDNN float32 linear here")


@pytest.fixture(autouse=True)
def _quiet_one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- the ops


class _Experts(torch.nn.Module):
    """What ``grouped_mm_experts_forward`` reads of an experts module (HF's default layout)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
        self.num_experts = gate_up.shape[0]
        self.act_fn = torch.nn.SiLU()
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _apply_gate(self, x):
        gate, up = x.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _case(seed: int, t: int, k: int, e: int, h: int, f: int, invalid: bool = False):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(e, 2 * f, h, generator=g) / h ** 0.5, torch.randn(e, h, f, generator=g) / f ** 0.5
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    if invalid and t:
        ids[0, -1] = e  # selects no expert (an expert-parallel sentinel): contributes 0
    w = torch.rand(t, k, generator=g)
    return x, ids, w, gate_up, down


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 12), k=st.integers(1, 3), e=st.sampled_from([3, 4, 8]), f=st.sampled_from([16, 48]),
       seed=st.integers(0, 2**31 - 1))
def test_moe_reference_equals_transformers_experts(t, k, e, f, seed):
    x, ids, w, gate_up, down = _case(seed, t, min(k, e), e, 32, f)
    want = transformers_moe.grouped_mm_experts_forward(_Experts(gate_up, down), x, ids, w)
    got = moe_op.moe_experts_reference(x, ids, w, *moe_op.pack_experts(gate_up, down))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_moe_kernel
@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 40), k=st.integers(1, 4), e=st.sampled_from([4, 8, 9]), h=st.sampled_from([16, 64]),
       f=st.sampled_from([16, 32, 80]), invalid=st.booleans(), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31 - 1))
def test_moe_kernel_equals_reference(t, k, e, h, f, invalid, threads, seed):
    """Row counts across the register tile (1..8 rows per expert and more), empty experts, k up to 4."""
    x, ids, w, gate_up, down = _case(seed, t, k, e, h, f, invalid)
    packed = moe_op.pack_experts(gate_up, down)
    assert all(torch.equal(a, b) for a, b in zip(moe_op.unpack_experts(*packed), (gate_up, down)))
    torch.set_num_threads(threads)
    got = torch.ops.devin.moe_experts(x, ids, w, *packed)
    want = moe_op.moe_experts_reference(x, ids, w, *packed)
    assert got.shape == (t, h)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_moe_kernel
def test_moe_kernel_strided_rows_and_fallback():
    """Rows with a stride (a slice of a wider tensor) run in the kernel; a bf16 call goes to the reference."""
    x, ids, w, gate_up, down = _case(3, 6, 2, 4, 32, 16)
    packed = moe_op.pack_experts(gate_up, down)
    wide = torch.cat([x, torch.randn(6, 8)], 1)[:, :32]
    torch.testing.assert_close(torch.ops.devin.moe_experts(wide, ids, w, *packed),
                               moe_op.moe_experts_reference(x, ids, w, *packed), atol=1e-5, rtol=1e-5)
    bf = [t.bfloat16() for t in packed]
    got = torch.ops.devin.moe_experts(x.bfloat16(), ids, w.bfloat16(), *bf)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, moe_op.moe_experts_reference(x.bfloat16(), ids, w.bfloat16(), *bf))


def test_pack_experts_refuses_unaligned_sizes():
    with pytest.raises(ValueError, match="multiples of 16"):
        moe_op.pack_experts(torch.zeros(2, 40, 32), torch.zeros(2, 32, 20))


@pytest.mark.skipif(not packed_op.load_cpu_kernel(), reason="no C/C++ compiler for the packed linear kernel")
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 19), n=st.sampled_from([1, 8, 16, 48, 250]), k=st.sampled_from([2, 30, 64]),
       bias=st.booleans(), lead=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_packed_gemm_linear_equals_reference(rows, n, k, bias, lead, threads, seed):
    """Row counts across the register tile; a row's result does not depend on the other rows."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=g), (torch.randn(n, generator=g) if bias else None)
    x = torch.randn(rows, k, generator=g)
    if lead:
        x = x[None]  # [1, rows, K]: how the prefill graph's logits rows come
    packed = packed_op.pack_weight(w)
    assert torch.equal(packed_op.unpack_weight(packed, n), w)
    got = torch.ops.devin.packed_gemm_linear(x, packed, b, n)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
    if rows:
        assert torch.equal(torch.ops.devin.packed_gemm_linear(x[..., -1:, :], packed, b, n), got[..., -1:, :])


# --------------------------------------------------------------------------- the pass, per family

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2)),
    "qwen2_moe": ("qwen2_moe", dict(_MOE, shared_expert_intermediate_size=48, num_key_value_heads=2)),
    "qwen3_moe_norm": ("qwen3_moe", dict(_MOE, head_dim=16, norm_topk_prob=True, num_key_value_heads=2)),
    "qwen3_moe": ("qwen3_moe", dict(_MOE, head_dim=16, norm_topk_prob=False, num_key_value_heads=2)),
    "olmoe": ("olmoe", dict(num_experts=8, num_experts_per_tok=4, intermediate_size=32, num_key_value_heads=2)),
    "deepseek_v3": ("deepseek_v3", FAMILIES["deepseek_v3"].config),  # sigmoid group router, shared experts
}
PROMPT_LENS, NEW_TOKENS = (5, 19, 37), 24


def _model(model_type: str, overrides: dict):
    return build_model(model_type, overrides, "sdpa")  # conftest's tiny defaults under the overrides


def _moe_layers(model) -> int:
    return sum(1 for name, _ in model.named_modules() if name.endswith(".experts"))


def _targets(opt) -> dict[str, list]:
    return {phase: [n.target for n in gm.graph.nodes if n.op == "call_function"]
            for phase, gm in opt.program.graphs.items()}


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@needs_moe_kernel
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_fused_experts_match_hf(family):
    model = _model(*MOE_FAMILIES[family])
    opt = optimize(model, num_kv_blocks=96)
    record = next(r for r in opt.pass_report.records if r.name == "fuse_moe_experts")
    layers = _moe_layers(model)
    assert record.matches == 2 * layers, record.note  # prefill and decode graphs
    assert "declined" not in record.note
    for phase, targets in _targets(opt).items():
        assert targets.count(torch.ops.devin.moe_experts.default) == layers, phase
        assert not any("grouped_mm_fallback" in str(t) or "grouped_linear" in str(t) for t in targets), phase

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        ref = model(torch.tensor([prompts[-1]])).logits[0]
    torch.testing.assert_close(opt(torch.tensor([prompts[-1]])).logits[0], ref, atol=ATOL, rtol=0)
    got = opt.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)  # one batch, three lengths
    for prompt, tokens in zip(prompts, got):
        assert tokens == _hf_greedy(model, prompt, NEW_TOKENS), f"{family}: prompt of {len(prompt)} tokens"


@needs_moe_kernel
@needs_onednn
@pytest.mark.parametrize("overrides,reason", [
    (dict(hidden_act="gelu"), "not SiLU"),
    (dict(intermediate_size=40), "not multiples of 16"),
])
def test_declined_experts_say_why_and_stay_correct(overrides, reason):
    model = _model("mixtral", {**MOE_FAMILIES["mixtral"][1], **overrides})
    opt = optimize(model, num_kv_blocks=16)
    record = next(r for r in opt.pass_report.records if r.name == "fuse_moe_experts")
    assert record.matches == 0 and reason in record.note, record.note
    assert "layers.0.mlp.experts.gate_up_proj" in record.note and "layers.1.mlp.experts.gate_up_proj" in record.note
    for targets in _targets(opt).values():
        assert targets.count(torch.ops.devin.grouped_linear.default) == 2 * model.config.num_hidden_layers
    ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits[0]
    torch.testing.assert_close(opt(ids).logits[0], ref, atol=ATOL, rtol=0)


@needs_moe_kernel
def test_linears_packed_in_both_graphs():
    """pack_gemm_linears: the logits linear everywhere, the rest (fused qkv, o_proj, the 4-expert router:
    N = 4, padded to one block) with AVX-512."""
    model = _model(*MOE_FAMILIES["mixtral"])
    opt = optimize(model, num_kv_blocks=16)
    record = next(r for r in opt.pass_report.records if r.name == "pack_gemm_linears")
    layers = model.config.num_hidden_layers
    want = 1 + 3 * layers if packed_op.serves_many_rows() else 1  # lm_head (+ fused qkv, o_proj, router)
    assert record.matches == 2 * want, record.note
    for phase, targets in _targets(opt).items():
        assert targets.count(torch.ops.devin.packed_gemm_linear.default) == want, phase


# --------------------------------------------------------------------------- grouped_linear / prepack_onednn_experts


@needs_onednn
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


@needs_onednn
def test_prepack_onednn_experts_rewrites_every_expert_gemm():
    """With fuse_moe_experts off, prepack_onednn_experts takes every expert GEMM."""
    fam = FAMILIES["mixtral"]
    model = build_model(fam.model_type, fam.config_kwargs(), "sdpa")
    opt = optimize(model, num_kv_blocks=16, fuse_moe_experts=False)
    for gm in opt.program.graphs.values():
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.devin.grouped_linear.default) == 2 * model.config.num_hidden_layers
        assert not any("grouped_mm_fallback" in str(t) for t in targets)
    ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits[0]
    torch.testing.assert_close(opt(ids).logits[0], ref, atol=1e-4, rtol=1e-4)
