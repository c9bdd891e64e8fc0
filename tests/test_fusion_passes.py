"""The rewrite passes keep values: each pass alone vs the paged graph without it.

fuse_rotary, fuse_attention_inputs and fuse_silu_mul are bit-identical in float32; fuse_rms_norm is equal up to the order of the
float32 sum of squares (bit-identical in bf16); fuse_projections is equal up to float32 GEMM
rounding; prepack_onednn_linears is bit-identical in bf16. Each pass must also
actually match (its count equals the number of sites in a 2-layer Llama).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from devin_compile.api import make_probe
from devin_compile.capture import capture
from devin_compile.passes import (AttentionToPaged, Cleanup, FuseAddRMSNorm, FuseAttentionInputs, FuseProjections,
                                  FuseRMSNorm, FuseRotary, FuseSiluMul, PrepackOneDNNLinears)
from devin_compile.pipeline import PassContext, PassManager, Program


def _model(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def _run(model, passes):
    gm, info = capture(model)
    program = Program({"main": gm})
    report = PassManager([AttentionToPaged(), *passes]).run(program, PassContext(info))
    with torch.no_grad():
        return make_probe(info, info.device)(program), report


@pytest.mark.parametrize("pass_cls,sites,exact", [
    (FuseRotary, 4, True),        # q and k in each of 2 layers
    (FuseRMSNorm, 5, False),      # 2 per layer + the final norm
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_op_cpu_kernel_matches_aten(dtype):
    """devin::rms_norm's C++ CPU kernel against aten.rms_norm (its Python kernel): bf16 exact,
    float32/fp16 within a few roundings; calls it does not serve are redispatched to aten."""
    from devin_compile.backends.fused import cpu_rms_norm_op

    if not cpu_rms_norm_op.load():
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(0)
    ulp = {torch.float32: 2 ** -20, torch.bfloat16: 0.0, torch.float16: 2 ** -10}[dtype]  # a few roundings
    for shape in [(1, 576), (3, 7, 64), (130, 96), (2, 1)]:
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        ref = torch.ops.aten.rms_norm.default(x, [shape[-1]], w, 1e-5)
        out = torch.ops.devin.rms_norm(x, w, 1e-5)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * ulp + 1e-30).all()
    x = torch.randn(6, 32, generator=g).to(dtype)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    for xi, wi in [(x.t(), torch.randn(6, generator=g).to(dtype)),           # non-contiguous x
                   (x, torch.randn(32, generator=g).to(other))]:               # another weight dtype
        ref = torch.ops.aten.rms_norm.default(xi, [xi.shape[-1]], wi, 1e-6)
        out = torch.ops.devin.rms_norm(xi, wi, 1e-6)
        assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("fused", [False, True])
def test_fuse_attention_inputs_bit_identical_fp32(fused):
    """rotary_heads replaces every layer's q/k/v chain (after fuse_rotary and cleanup's CSE),
    with or without fused projections, and the logits do not change by a bit; cleanup leaves
    one reshape between attention and o_proj."""
    model = _model(torch.float32)
    before = [FuseRotary(), *([FuseProjections()] if fused else []), Cleanup()]
    base, _ = _run(model, before)
    out, report = _run(model, [*before, FuseAttentionInputs()])
    assert report.records[-1].matches == 2
    assert torch.equal(out, base)
    gm, info = capture(model)
    program = Program({"main": gm})
    PassManager([AttentionToPaged(), *before, FuseAttentionInputs()]).run(program, PassContext(info))
    nodes = list(program.graphs["main"].graph.nodes)
    targets = [n.target for n in nodes]
    assert torch.ops.aten.roll.default not in targets and torch.ops.aten.squeeze.dim not in targets
    for attn in (n for n in nodes if n.target is torch.ops.devin.paged_attention.default):
        assert all(a.args[0].target is torch.ops.devin.rotary_heads.default for a in attn.args[:3])
        (user,) = attn.users
        assert user.target is torch.ops.aten.reshape.default  # was unsqueeze, transpose, reshape, transpose, reshape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_add_rms_norm_bit_identical(dtype):
    """Each residual add feeding a norm (layer 0's post-attention norm, both of layer 1's, the final
    norm) becomes one devin::add_rms_norm, and the logits do not change by a bit."""
    from devin_compile.backends.fused import cpu_rms_norm_op

    if not cpu_rms_norm_op.load():
        pytest.skip("no C++ compiler here")
    model = _model(dtype)
    before = [FuseRMSNorm(), Cleanup()]
    base, _ = _run(model, before)
    out, report = _run(model, [*before, FuseAddRMSNorm()])
    assert report.records[-1].matches == 4
    assert torch.equal(out, base)
    targets = {}
    for fused in (False, True):
        gm, info = capture(model)
        program = Program({"main": gm})
        PassManager([AttentionToPaged(), *before, *([FuseAddRMSNorm()] if fused else [])]).run(program, PassContext(info))
        targets[fused] = [n.target for n in program.graphs["main"].graph.nodes]
    after = targets[True]
    assert after.count(torch.ops.devin.rms_norm.default) == 1  # layer 0's input norm: no add before it
    assert after.count(torch.ops.devin.add_rms_norm.default) == 4
    add = torch.ops.aten.add.Tensor  # the residual adds are gone, not only bypassed (rotary keeps its adds)
    assert after.count(add) == targets[False].count(add) - 4


def test_fuse_add_rms_norm_skipped_without_a_compiler(monkeypatch):
    """Where the C++ kernel cannot be built the pass is skipped with the reason, and the graph keeps
    its adds and norms (the op's Python kernel would cost more than the two ops it replaces)."""
    from devin_compile.ops import rms_norm as rms_norm_op

    monkeypatch.setattr(rms_norm_op, "load_cpu_kernel", lambda: False)
    model = _model(torch.float32)
    base, _ = _run(model, [FuseRMSNorm(), Cleanup()])
    out, report = _run(model, [FuseRMSNorm(), Cleanup(), FuseAddRMSNorm()])
    rec = report.records[-1]
    assert rec.status == "skipped" and "compiler" in rec.note
    assert torch.equal(out, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_rms_norm_cpu_kernel_equals_add_then_norm(dtype):
    """devin::add_rms_norm's C++ kernel gives exactly the add and devin::rms_norm's kernel (the sum
    rounded once, like aten's add); calls it does not serve go to the Python kernel, same values."""
    from devin_compile.backends.fused import cpu_rms_norm_op

    if not cpu_rms_norm_op.load():
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 576), (3, 7, 64), (130, 96)]:
        x, r = ((torch.randn(*shape, generator=g) * 3).to(dtype) for _ in range(2))
        w = torch.randn(shape[-1], generator=g).to(dtype)
        y, s = torch.ops.devin.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s, x + r)
        assert torch.equal(y, torch.ops.devin.rms_norm(x + r, w, 1e-5))
    x = torch.randn(6, 32, generator=g).to(dtype)
    for xi, ri in [(x.t().contiguous().t(), x), (x, torch.randn(32, generator=g).to(dtype))]:  # strided; broadcast
        y, s = torch.ops.devin.add_rms_norm(xi, ri, torch.ones(32, dtype=dtype), 1e-6)
        assert torch.equal(s, xi + ri)
        assert torch.equal(y, torch.ops.aten.rms_norm.default(xi + ri, [32], torch.ones(32, dtype=dtype), 1e-6))


def test_fuse_silu_mul_bit_identical_fp32():
    """After fuse_projections, each layer's split + silu + mul becomes one devin::silu_mul."""
    model = _model(torch.float32)
    base, _ = _run(model, [FuseProjections()])
    out, report = _run(model, [FuseProjections(), FuseSiluMul()])
    assert report.records[-1].matches == 2
    assert torch.equal(out, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_cpu_kernel_equals_python_kernel(dtype):
    """The C++ kernel makes the Python kernel's aten calls: equal bit for bit, also on a strided
    input; an odd last dimension is an error naming it."""
    from devin_compile.backends.fused import cpu_silu_mul_op
    from devin_compile.ops.silu_mul import silu_mul

    if not cpu_silu_mul_op.load():
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(0)
    for x in [torch.randn(1, 3, 64, generator=g), torch.randn(5, 2 * 1536, generator=g),
              torch.randn(4, 100, generator=g)[:, 10:74], torch.randn(0, 8, generator=g)]:
        x = (x * 4).to(dtype)
        out = torch.ops.devin.silu_mul(x)
        ref = silu_mul(x)
        assert out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref)
    with pytest.raises(RuntimeError, match=r"last dimension \(7\) must be even"):
        torch.ops.devin.silu_mul(torch.randn(2, 7).to(dtype))


def _rotary_inputs(t, kv_heads, group, d, dtype, fused, seed):
    g = torch.Generator().manual_seed(seed)
    widths = [kv_heads * group * d, kv_heads * d, kv_heads * d]
    if fused:  # row-strided slices of one projection, as after fuse_projections
        q, k, v = torch.randn(1, t, sum(widths), generator=g).to(dtype).split(widths, -1)
    else:
        q, k, v = (torch.randn(1, t, w, generator=g).to(dtype) for w in widths)
    ang = torch.rand(t, 1, generator=g) * 50 * torch.rand(d // 2, generator=g)
    emb = torch.cat([ang, ang], -1)
    return q, k, v, emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 20), kv_heads=st.integers(1, 3), group=st.integers(1, 3), d=st.sampled_from([2, 8, 64, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), fused=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rotary_heads_cpu_kernel_matches_hf_rotary(t, kv_heads, group, d, dtype, fused, seed):
    """devin::rotary_heads (C++ kernel where it builds) against HF's own apply_rotary_pos_emb on
    [1, H, T, D] heads: bit-identical in every dtype, contiguous [T, H, D] outputs."""
    from devin_compile.backends.fused import cpu_rotary_op

    cpu_rotary_op.load()
    q, k, v, cos, sin = _rotary_inputs(t, kv_heads, group, d, dtype, fused, seed)
    heads = lambda x: x.view(1, t, x.shape[-1] // d, d).transpose(1, 2)  # noqa: E731
    q_ref, k_ref = apply_rotary_pos_emb(heads(q), heads(k), cos[0], sin[0])
    signed = torch.cat([-sin[..., : d // 2], sin[..., d // 2:]], -1)  # fuse_rotary's sin'
    out = torch.ops.devin.rotary_heads(q, k, v, cos, signed, d)
    for o, ref in zip(out, (q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1), v.view(t, kv_heads, d))):
        assert o.dtype == dtype and o.shape == ref.shape and o.is_contiguous()
        assert torch.equal(o, ref)
    assert out[2].data_ptr() != v.data_ptr() or t == 0  # outputs never alias the inputs


def test_rotary_heads_unserved_calls_use_the_python_kernel():
    """Calls the C++ kernel does not serve (mixed dtypes, a strided last dim) give the Python
    kernel's result, and so does an empty step (the Python kernel handles T = 0 too)."""
    from devin_compile.backends.fused import cpu_rotary_op
    from devin_compile.ops.rotary_heads import rotary_heads

    if not cpu_rotary_op.load():
        pytest.skip("no C++ compiler here")
    q, k, v, cos, sin = _rotary_inputs(5, 2, 2, 8, torch.bfloat16, False, 0)
    strided = torch.randn(1, 5, 32, 2, dtype=torch.bfloat16)[..., 0]
    empty = [x[:, :0] for x in (q, k, v)] + [cos[:, :, :0], sin[:, :, :0]]
    for args in [(q, k, v, cos.float(), sin.float()), (strided, k, v, cos, sin), empty]:
        out = torch.ops.devin.rotary_heads(*args, 8)
        for o, ref in zip(out, rotary_heads(*args, 8)):
            assert o.dtype == ref.dtype and torch.equal(o, ref)


def test_prepack_onednn_linears_bit_identical_bf16():
    model = _model(torch.bfloat16)
    base, _ = _run(model, [])
    out, report = _run(model, [PrepackOneDNNLinears()])
    rec = report.records[-1]
    if rec.status == "skipped":
        pytest.skip(rec.note)
    assert rec.matches == 2 * 7 + 1  # 7 linears per layer + lm_head
    assert torch.equal(out, base)


def test_upcast_linear_function(monkeypatch):
    """Below ``min_rows`` it is the bf16 linear itself; from it on, float32 math over weight
    chunks (chunking forced small here), rounded back to bf16."""
    from devin_compile.ops import upcast_linear as op

    monkeypatch.setattr(op, "CHUNK_ROWS", 16)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    few, many = torch.randn(1, 3, 24, generator=g).bfloat16(), torch.randn(2, 5, 24, generator=g).bfloat16()
    assert torch.equal(op.upcast_linear(few, w, b, 8), torch.nn.functional.linear(few, w, b))
    out = op.upcast_linear(many, w, b, 8)
    assert out.shape == (2, 5, 40) and out.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(many.double(), w.double(), b.double())
    assert (out.double() - exact).abs().max() <= exact.abs().max() * 2 ** -8  # one bf16 rounding


def test_upcast_linear_pass_bf16(monkeypatch):
    """Every linear is rewritten (7 per layer + lm_head) and the probe (12 tokens: the float32
    path) stays within bf16 rounding of the plain bf16 graph."""
    import devin_compile.passes.upcast_linear as up

    monkeypatch.setattr(up, "onednn_supports", lambda dtype: False)  # whatever this CPU has
    model = _model(torch.bfloat16)
    base, _ = _run(model, [])
    out, report = _run(model, [up.UpcastLinear()])
    rec = report.records[-1]
    assert rec.status == "ran" and rec.matches == 2 * 7 + 1
    assert (out.float() - base.float()).abs().max() <= 0.05 * base.float().abs().max()
    fp32, _ = _run(_model(torch.float32), [])
    # no less accurate than the bf16 linears, against the float32 model
    assert (out.float() - fp32).abs().mean() <= 1.1 * (base.float() - fp32).abs().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cpu_kernel_equals_its_definition(dtype):
    """devin::rms_norm's C++ kernel: the mean square summed in double (in lanes), ``inv = 1 / sqrt(float(mean) +
    eps)`` in float32, ``(x * inv) * w`` rounded once to the dtype (bf16: to nearest even, as torch rounds),
    NaN rows NaN; at one row and at many (rows split over threads)."""
    from devin_compile.backends.fused import cpu_rms_norm_op

    if not cpu_rms_norm_op.load():
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(3)
    for rows, d in [(1, 576), (64, 576), (130, 37), (3, 8)]:
        x = (torch.randn(rows, d, generator=g) * 4).to(dtype)
        x[-1, 0] = float("nan") if rows > 1 else x[-1, 0]
        w = torch.randn(d, generator=g).to(dtype)
        got = torch.ops.devin.rms_norm(x, w, 1e-5)
        mean = (x.double().pow(2).sum(-1) / d).float()
        inv = 1 / torch.sqrt(mean + 1e-5)
        want = ((x.float() * inv[:, None]) * w.float()).to(dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert rows == 1 or torch.isnan(got[-1]).all()
