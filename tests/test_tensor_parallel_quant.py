"""Tensor parallelism with quantized linears (issue 40, "quantized shards"): each rank holds its slice of the
INT4 / FP8 weights (and of the INT8 or INT4 head) and two gloo ranks give the tokens of one process with the
same quantization.

The ranks (``tp_worker.py``, started by :func:`test_tensor_parallel.launch`) quantize the tiny seeded models
with RTN (deterministic: every rank computes the same full quantization, then keeps its slices) or load one
saved artifact; the test runs the same workload in one process. A row-parallel cut that is not whole INT4
groups is refused by name while planning, before any weight is split.
"""
from __future__ import annotations

import re

import pytest
import torch

from devin_compile.backends.fp8 import format as fp8_fmt
from devin_compile.backends.int4 import format as int4_fmt
from devin_compile.capture import capture, model_info
from devin_compile.config.tensor_parallel import TensorParallelSpec
from devin_compile.config.weight_slice import WeightSlice
from devin_compile.passes.assign_precision.shards import shard_qlinear
from devin_compile.passes import AttentionToPaged, ShardTensorParallel
from devin_compile.pipeline import PassContext, PassError, PassManager, Program
from devin_compile.quant import QuantConfig, artifact, quantize_for_optimize
from devin_compile.quant.result import QLinear

from test_quant_data import CharTokenizer
from test_tensor_parallel import assert_matches, launch
from tp_worker import _RTN, build, run_case

#: CASE%QUANT (tp_worker.QUANT): INT4 decoder linears + the INT8 head on llama, qwen2 (q/k/v biases) and mixtral
#: (attention quantized, experts split dense), FP8 decoder linears, a tied table over an uneven vocabulary (251
#: rows: rank 1's shard has a zero row) read by the INT8 head and the lookup, or by the INT4 head and its lookup,
#: and saved INT4 artifacts (RTN; AWQ, whose input scales and folded row scales are cut with the weights)
QUANT_RUNS = ["llama%int4", "qwen2%int4", "mixtral%int4", "llama%fp8", "llama_tied%int4", "llama_tied%int4_head",
              "llama%artifact", "llama%awq_artifact"]


@pytest.fixture(scope="module")
def saved_artifact(tmp_path_factory) -> str:
    """The tiny llama quantized with RTN and with AWQ (g32, INT8 head), saved in ``rtn/`` and ``awq/``: what
    ``quantized=`` loads (one quantization that every rank and the reference read)."""
    out = tmp_path_factory.mktemp("tp_artifact")
    for method in ("rtn", "awq"):
        model = build("llama")
        result = quantize_for_optimize(model, CharTokenizer(), QuantConfig.coerce({**_RTN, "method": method}))
        assert (result.linears["model.layers.0.mlp.down_proj"].in_scale is not None) == (method == "awq")  # row cut
        assert (result.linears["model.layers.0.mlp.up_proj"].row_scale is not None) == (method == "awq")  # column cut
        artifact.save(result, out / method)
    return str(out)


@pytest.fixture(scope="module")
def quant_ranks(tmp_path_factory, saved_artifact) -> list[dict]:
    return launch(tmp_path_factory.mktemp("tp_quant"), *QUANT_RUNS, env={"TP_QUANT_ARTIFACT": saved_artifact})


@pytest.mark.parametrize("run", QUANT_RUNS)
def test_quantized_ranks_match_one_process(quant_ranks, saved_artifact, monkeypatch, run):
    """Greedy tokens identical to one process with the same quantization on both ranks, logits within
    summation-order tolerance; every rank chose each linear's precision as one process did, and reports
    its quantized linears as this rank's slices."""
    monkeypatch.setenv("TP_QUANT_ARTIFACT", saved_artifact)
    ref = run_case(run, 1)
    assert_matches(ref, quant_ranks, run)
    for results in quant_ranks:
        got = results[run]
        assert [r[:2] for r in got["precision"]] == [r[:2] for r in ref["precision"]]
        n = len([r for r in ref["precision"] if r[1] in ("int4", "fp8")])
        assert n > 0 and re.search(rf"tensor parallel: {n} of \d+ linears hold this rank's slice",
                                   got["precision_note"])
    kind = run.partition("%")[2]
    expected = "fp8" if kind == "fp8" else "int4"
    assert {r[1] for r in ref["precision"] if r[0] != "lm_head"} == {expected}
    head = next(r[1] for r in ref["precision"] if r[0] == "lm_head")
    assert head == ("int4" if kind == "int4_head" else "int8")
    if run.startswith("llama_tied"):
        assert "1 tied embedding reads the" in ref["precision_note"]
        assert all("1 tied embedding reads the" in r[run]["precision_note"] for r in quant_ranks)


@pytest.mark.parametrize("run", QUANT_RUNS)
def test_quantized_bytes_per_rank(quant_ranks, saved_artifact, monkeypatch, run):
    """Each rank holds half of every INT4 decoder linear's bytes (the model's heads and MLP split evenly over
    2 ranks; FP8: half the codes, the row scales of a row-parallel linear whole) and ⌈V/2⌉ of the V rows of
    the quantized head."""
    monkeypatch.setenv("TP_QUANT_ARTIFACT", saved_artifact)
    ref = {r[0]: r[2] for r in run_case(run, 1)["precision"]}
    vocab = build(run.partition("%")[0]).config.vocab_size
    for results in quant_ranks:
        got = {r[0]: r[2] for r in results[run]["precision"]}
        body = [n for n in ref if n != "lm_head"]
        share = sum(got[n] for n in body) / sum(ref[n] for n in body)
        if run.endswith("fp8"):  # a row-parallel linear's per-row FP8 scales are whole on every rank
            assert 0.5 < share < 0.51
        else:
            assert all(got[n] * 2 == ref[n] for n in body)
        per = -(-vocab // 2)
        assert abs(got["lm_head"] / ref["lm_head"] - per / vocab) < 0.01


@pytest.mark.parametrize("group_size, layer, cut", [
    (64, "layers.0.self_attn", r"\[0, 32\) of 64"),  # o_proj reads 4 heads of 16: rank 0 keeps half a group
    (128, "layers.0.mlp", r"\[0, 64\) of 128"),  # down_proj reads 128 features: rank 0 keeps half a group
])
def test_row_cut_off_a_group_boundary_is_refused(group_size, layer, cut):
    """A row-parallel linear whose rank's input columns are not whole INT4 groups: a PassError naming the
    layer, the group size and the way out, raised while planning, before any weight is split."""
    model = build("llama")
    gm, info = capture(model, info=model_info(model))
    program = Program({"main": gm})
    PassManager([AttentionToPaged()]).run(program, PassContext(info=info))
    gm = program.main
    groups = {"model.layers.0.self_attn.o_proj": 32 if layer.endswith("mlp") else group_size,
              "model.layers.0.mlp.down_proj": 32 if layer.endswith("self_attn") else group_size}
    shapes = {n: tuple(p.shape) for n, p in gm.named_parameters()}
    with pytest.raises(PassError, match=rf"{layer}\.\w+_proj: tensor_parallel=2 gives rank 0 its input features "
                                        rf"{cut}, which do not fall on the INT4 group boundaries .*\(group size "
                                        rf"{group_size}\).* or use tensor_parallel=1"):
        ShardTensorParallel(TensorParallelSpec(2, 0, "tp-test"), groups).run_graph(gm, "main", PassContext(info=info))
    assert {n: tuple(p.shape) for n, p in gm.named_parameters()} == shapes


def _qlinear(n: int = 6, k: int = 80, g: int = 32) -> QLinear:
    """A quantized [n, k] linear with a short last group (80 = 2·32 + 16), AWQ scales and FP8 codes."""
    torch.manual_seed(0)
    w = torch.randn(n, k)
    q, scale, minv = int4_fmt.rtn_quantize(w, g)
    q8, s8 = fp8_fmt.quantize(w)
    return QLinear(q, scale, minv, g, "", 0.0, 1.0, in_scale=torch.rand(k) + 0.5, row_scale=torch.rand(n) + 0.5,
                   fp8_q=q8, fp8_scale=s8)


@pytest.mark.parametrize("cut", [WeightSlice(0, (range(2, 5),), 6), WeightSlice(0, (range(3, 6),), 6, padded_to=4),
                                 WeightSlice(1, (range(0, 32),), 80), WeightSlice(1, (range(32, 80),), 80)])
def test_a_slice_dequantizes_to_the_slice_of_the_weight(cut):
    """Rows (padded with zero rows for a vocabulary shard) or whole groups of columns (the last one short) of the
    INT4 and FP8 weights dequantize to the same cut of the full dequantized weights; AWQ's scales follow."""
    full = _qlinear()
    part = shard_qlinear(full, cut, "x")
    assert part.shape == ((cut.length, 80) if cut.dim == 0 else (6, cut.length))
    torch.testing.assert_close(part.dequantized(), cut.take(full.dequantized()), rtol=0, atol=0)
    torch.testing.assert_close(part.fp8_dequantized(), cut.take(full.fp8_dequantized()), rtol=0, atol=0)
    scaled, whole = ("row_scale", "in_scale") if cut.dim == 0 else ("in_scale", "row_scale")
    torch.testing.assert_close(getattr(part, scaled), cut.take(getattr(full, scaled), dim=0, fill=1.0))
    assert getattr(part, whole) is getattr(full, whole)


def test_a_column_slice_off_a_group_boundary_is_refused():
    with pytest.raises(PassError, match=r"x's input features \[16, 48\) of 80 are not whole INT4 groups of 32"):
        shard_qlinear(_qlinear(), WeightSlice(1, (range(16, 48),), 80), "x")
