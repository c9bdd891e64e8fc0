"""The INT8 output head (``lm_head="int8"``, the default of INT4 quantization): devin::int8_linear equals
the dequantized product in every layout, devin::int8_embedding reads the head's rows for a tied embedding,
the compiled model equals its eager simulation and keeps no dense table, and the artifact round-trips."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile
import devin_compile.ops  # noqa: F401  (registers the devin:: ops)
from devin_compile.backends.fp8 import cpu_fp8_linear
from devin_compile.backends.int8 import format as int8_fmt
from devin_compile.backends.int8 import kernels
from devin_compile.quant import artifact, simulate
from devin_compile.quant.config import QuantConfig
from devin_compile.weights import held_tensors

CPU = torch.device("cpu")


class CharTokenizer:
    """Enough of a tokenizer for calibration text: one id per character."""

    def __call__(self, text, add_special_tokens=False, **_):
        return {"input_ids": [3 + ord(c) % 250 for c in text]}


def _kernels():
    return ["reference"] + (["cpu_c"] if cpu_fp8_linear.available() else [])


def test_format_rounds_each_row_to_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(40, 70) * torch.rand(40, 1) * 3
    w[5] = 0
    q, scale = int8_fmt.quantize(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scale[5] == 1
    err = (int8_fmt.dequantize(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert int8_fmt.int8_bytes(40, 70) == 40 * 70 + 160


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("n,k", [(50, 64), (33, 96), (77, 130), (8, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_the_dequantized_product(kernel, n, k, dtype):
    torch.manual_seed(n + k)
    q, scale = int8_fmt.quantize(torch.randn(n, k))
    qw, sc = kernels.prepare(kernel, q, scale, CPU)
    bias = torch.randn(n).to(dtype)
    for m in (1, 3, 5, 9):
        x = torch.randn(2, m, k).to(dtype)
        want = x.float() @ int8_fmt.dequantize(q, scale).t() + bias.float()
        got = torch.ops.devin.int8_linear(x, qw, sc, n, kernel, bias)
        assert got.shape == (2, m, n) and got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    if kernel == "cpu_c":  # the portable path agrees with the vector one
        x = torch.randn(3, k)
        torch.testing.assert_close(cpu_fp8_linear.fp8_mm(x, qw, sc, n, scalar=True, codes="int8"),
                                   cpu_fp8_linear.fp8_mm(x, qw, sc, n, codes="int8"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", _kernels())
def test_prepared_operands_share_no_storage_with_the_inputs(kernel):
    """A view of a memory-mapped artifact's tensor would keep the whole mapping resident."""
    q, scale = int8_fmt.quantize(torch.randn(8, 64))
    qw, sc = kernels.prepare(kernel, q, scale, CPU)
    assert qw.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    assert sc.untyped_storage().data_ptr() != scale.untyped_storage().data_ptr()


@pytest.mark.parametrize("kernel", _kernels())
def test_embedding_rows_equal_the_dequantized_weight(kernel):
    torch.manual_seed(1)
    n, k = 51, 96
    q, scale = int8_fmt.quantize(torch.randn(n, k))
    qw, sc = kernels.prepare(kernel, q, scale, CPU)
    ids = torch.randint(0, n, (3, 7))
    got = torch.ops.devin.int8_embedding(ids, qw, sc, n, k, kernel, torch.float32)
    assert torch.equal(got, int8_fmt.dequantize(q, scale)[ids])
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 51\)"):
        torch.ops.devin.int8_embedding(torch.tensor([n]), qw, sc, n, k, kernel, torch.float32)


def test_lm_head_option():
    assert QuantConfig().lm_head == "int8"
    assert QuantConfig(lm_head=True).lm_head == "int4" and QuantConfig(lm_head=None).lm_head is False
    with pytest.raises(ValueError, match="lm_head='int2' is unsupported; valid: 'int8'"):
        QuantConfig(lm_head="int2")


def _llama(tied: bool, seed: int = 3):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
                      max_position_embeddings=256, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_tied_embedding_reads_the_int8_head(method, tmp_path):
    """By default the head is INT8 and a tied embedding reads its rows: no dense table is held, the compiled
    model equals the eager simulation (greedy tokens too), and a saved artifact compiles to the same model."""
    model = _llama(tied=True)
    table = model.get_input_embeddings().weight
    quant = {"method": method, "group_size": 32, "calib_chunks": 2, "calib_len": 64}
    opt = devin_compile.optimize(model, tokenizer=CharTokenizer(), keep_quant_result=True, quantization=quant)
    note = next(r for r in opt.pass_report.records if r.name == "assign_precision").note
    assert "lm_head int8" in note and "1 tied embedding reads the INT8 head" in note
    assert any(r["linear"] == "lm_head" and r["precision"] == "int8" for r in opt.precision_table)
    for gm in opt.program.graphs.values():
        targets = [n.target for n in gm.graph.nodes]
        assert targets.count(torch.ops.devin.int8_linear.default) == 1
        assert targets.count(torch.ops.devin.int8_embedding.default) == 1
        assert torch.ops.aten.embedding.default not in targets
    held = {t.untyped_storage().data_ptr() for ts in held_tensors(opt).values() for t in ts
            if t.layout == torch.strided}
    assert table.untyped_storage().data_ptr() not in held  # no dense table kept
    res = opt.quant_result
    assert res.head is None and res.int8_head.name == "lm_head" and res.int8_head.loss_delta is not None
    sim = simulate(model, res)
    assert torch.equal(sim.model.embed_tokens.weight, res.int8_head.dequantized())
    assert (sim.lm_head.weight - table).abs().max() > 0  # the head really is quantized
    ids = torch.randint(3, 256, (1, 30))
    with torch.no_grad():
        ref = sim(ids).logits
    torch.testing.assert_close(opt(ids).logits, ref, rtol=0, atol=1e-4)
    prompt = [5, 6, 7, 8]
    tokens = opt.generate([prompt], max_new_tokens=8)[0]
    assert tokens == sim.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    artifact.save(res, tmp_path / "q")
    loaded = artifact.load(tmp_path / "q", model)
    assert torch.equal(loaded.int8_head.q, res.int8_head.q) and torch.equal(loaded.int8_head.scale, res.int8_head.scale)
    again = devin_compile.optimize(model, quantized=str(tmp_path / "q"))
    assert again.generate([prompt], max_new_tokens=8)[0] == tokens


def test_untied_int8_head_and_kept_head():
    """An untied head goes INT8 and leaves the embedding's table alone; lm_head=False keeps it dense."""
    model = _llama(tied=False, seed=4)
    quant = {"method": "rtn", "group_size": 32, "calib_chunks": 2, "calib_len": 64}
    opt = devin_compile.optimize(model, tokenizer=CharTokenizer(), keep_quant_result=True, quantization=quant)
    note = next(r for r in opt.pass_report.records if r.name == "assign_precision").note
    assert "lm_head int8" in note and "tied embedding reads" not in note
    sim = simulate(model, opt.quant_result)
    assert torch.equal(sim.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = torch.randint(3, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(opt(ids).logits, sim(ids).logits, rtol=0, atol=1e-4)
    kept = devin_compile.optimize(model, tokenizer=CharTokenizer(), quantization={**quant, "lm_head": False})
    for gm in kept.program.graphs.values():
        assert torch.ops.devin.int8_linear.default not in [n.target for n in gm.graph.nodes]


def test_corrupt_int8_head_in_an_artifact_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _llama(tied=True, seed=5)
    opt = devin_compile.optimize(model, tokenizer=CharTokenizer(), keep_quant_result=True, quantization={
        "method": "rtn", "group_size": 32, "calib_chunks": 2, "calib_len": 64})
    artifact.save(opt.quant_result, tmp_path)
    tensors = load_file(str(tmp_path / artifact.TENSORS_FILE))
    tensors["lm_head.int8_scale"][3] = float("nan")
    save_file(tensors, str(tmp_path / artifact.TENSORS_FILE))
    with pytest.raises(ValueError, match="lm_head has INT8 values of -128 or scales that are not finite"):
        artifact.load(tmp_path, model)


def test_offloading_a_quantized_head_is_refused_with_the_way_out():
    """offload_layers=["lm_head"] moves only a head in the model dtype: with the INT8 head (the default), off
    the CPU optimize() refuses before quantizing, and the pass itself (forced on this CPU) names lm_head=False."""
    from devin_compile.config import OptimizeConfig
    from devin_compile.passes import OffloadEmbeddings
    from devin_compile.passes.offload_embeddings import quantized_roles
    from devin_compile.pipeline import PassContext, PassError

    model = _llama(tied=True)
    quant = {"method": "rtn", "group_size": 32, "calib_chunks": 1, "calib_len": 32}
    with pytest.raises(ValueError, match=r"lm_head': False"):
        devin_compile.optimize(model, tokenizer=CharTokenizer(), device="cuda", offload_layers=["lm_head"],
                               quantization=quant)
    opt = devin_compile.optimize(model, tokenizer=CharTokenizer(), quantization=quant)
    ctx = PassContext(info=opt.info, config=OptimizeConfig())
    for roles, named in (({"lm_head"}, "lm_head"), ({"embedding"}, "embedding")):
        with pytest.raises(PassError, match=rf"the {named} of this model is quantized.*'lm_head': False"):
            OffloadEmbeddings(roles, force=True).run(opt.program, ctx)
    kept = devin_compile.optimize(model, tokenizer=CharTokenizer(), quantization={**quant, "lm_head": False})
    graphs = kept.program.graphs.values()
    assert all(any(n.target is torch.ops.devin.int4_linear.default for n in gm.graph.nodes) for gm in graphs)
    assert not any(quantized_roles(gm) for gm in graphs)  # the decoder's INT4 linears are not taken for the head
