"""devin::int4_embedding: a tied embedding reads the rows of its INT4 output head (lm_head=True), so the model
keeps no dense table; rows equal the head's dequantized weight in every layout, and the compiled model equals
its eager simulation."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile
import devin_compile.ops  # noqa: F401  (registers the devin:: ops)
from devin_compile.backends.int4 import format as fmt
from devin_compile.backends.int4 import kernels
from devin_compile.quant import simulate
from devin_compile.weights import held_tensors


class CharTokenizer:
    """Enough of a tokenizer for calibration text: one id per character."""

    def __call__(self, text, add_special_tokens=False, **_):
        return {"input_ids": [3 + ord(c) % 250 for c in text]}


@pytest.mark.parametrize("kernel", ["cpu_c", "cpu", "reference"])
@pytest.mark.parametrize("n,k,g", [(50, 64, 32), (33, 96, 32), (70, 128, 64)])
def test_rows_equal_the_dequantized_weight(kernel, n, k, g):
    if kernel == "cpu_c" and not kernels.cpu_int4_linear.available():
        pytest.skip("no C compiler here")
    torch.manual_seed(n + k)
    q, scale, minv = fmt.rtn_quantize(torch.randn(n, k), g)
    qw, sz = kernels.prepare(kernel, q, scale, minv, g, torch.float32, torch.device("cpu"))
    want = fmt.dequantize(q, scale, minv, g)
    ids = torch.randint(0, n, (3, 7))
    got = torch.ops.devin.int4_embedding(ids, qw, sz, g, n, k, kernel, torch.float32)
    assert got.shape == (3, 7, k)
    if kernel == "cpu_c":
        assert torch.equal(got, want[ids])  # same arithmetic as dequantize
    else:
        torch.testing.assert_close(got, want[ids], rtol=0, atol=1e-5)
    with pytest.raises(IndexError, match=r"token ids must be in \[0, "):
        torch.ops.devin.int4_embedding(torch.tensor([n]), qw, sz, g, n, k, kernel, torch.float32)


def _tied_llama():
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
                      max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_tied_embedding_reads_the_int4_head(method):
    """Every method: the embedding reads the INT4 head's rows (AWQ's input scale undone per column), the dense
    table is released, and the compiled model equals the eager simulation (greedy tokens too)."""
    model = _tied_llama()
    table = model.get_input_embeddings().weight
    opt = devin_compile.optimize(model, tokenizer=CharTokenizer(), keep_quant_result=True, quantization={
        "method": method, "group_size": 32, "calib_chunks": 4, "calib_len": 64, "lm_head": True})
    note = next(r for r in opt.pass_report.records if r.name == "assign_precision").note
    assert "1 tied embedding reads the INT4 head" in note
    for gm in opt.program.graphs.values():
        nodes = list(gm.graph.nodes)
        lookups = [n for n in nodes if n.target is torch.ops.devin.int4_embedding.default]
        assert len(lookups) == 1 and (len(lookups[0].args) == 9) == (method == "awq")  # AWQ: + col_scale
        assert not any(n.target is torch.ops.aten.embedding.default for n in nodes)
    held = {t.untyped_storage().data_ptr() for ts in held_tensors(opt).values() for t in ts
            if t.layout == torch.strided}
    assert table.untyped_storage().data_ptr() not in held  # no dense table kept
    sim = simulate(model, opt.quant_result)
    head = opt.quant_result.linears["lm_head"]
    assert torch.equal(sim.model.embed_tokens.weight, head.embedding_rows())
    if method != "awq":
        assert torch.equal(sim.model.embed_tokens.weight, sim.lm_head.weight)
    assert (sim.model.embed_tokens.weight - table).abs().max() > 0  # the table really is quantized
    ids = torch.randint(3, 256, (1, 30))
    with torch.no_grad():
        ref, base = sim(ids).logits, model(ids).logits
    out = opt(ids).logits
    assert (out - ref).abs().max() <= 1e-4
    assert (out - base).abs().max() > 1e-4
    prompt = [5, 6, 7, 8]
    assert opt.generate([prompt], max_new_tokens=8)[0] == sim.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()


def test_untied_head_leaves_the_embedding():
    """A head that is not tied: the embedding keeps its own table, the simulation too."""
    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    opt = devin_compile.optimize(model, tokenizer=CharTokenizer(), keep_quant_result=True, quantization={
        "method": "rtn", "group_size": 32, "calib_chunks": 2, "calib_len": 64, "lm_head": True})
    note = next(r for r in opt.pass_report.records if r.name == "assign_precision").note
    assert "tied embedding reads" not in note
    assert torch.equal(simulate(model, opt.quant_result).model.embed_tokens.weight, model.model.embed_tokens.weight)
