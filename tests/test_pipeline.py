"""PassManager and the optimize() pipeline: order validation, report, dumps, verify, attention_to_paged.

Order/report/skip tests run on small ``symbolic_trace`` graphs (no capture). The rest share
one captured tiny Llama (3 layers, GQA 4:2) per fixture; nothing is downloaded.
"""
from __future__ import annotations

import operator
import os
import re
import types

import pytest
import torch
import torch.fx
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile as dc
from devin_compile.api import make_probe
from devin_compile.capture import capture
from devin_compile.config import OptimizeConfig
from devin_compile.graph_utils import add_call
from devin_compile.passes import AttentionToPaged, Cleanup
from devin_compile.pipeline import Pass, PassContext, PassError, PassManager, PassResult, Program

aten = torch.ops.aten
NUM_LAYERS = 3



def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


# ----------------------------------------------------------------------------------------
# Order validation


def make_pass(name: str, requires: tuple[str, ...] = (), skip: str | None = None, calls: list | None = None) -> Pass:
    def run_graph(self, gm, phase, ctx):
        if calls is not None:
            calls.append(name)
        return PassResult()

    cls = type(f"P_{name}", (Pass,), {
        "name": name, "requires": tuple(requires), "run_graph": run_graph,
        "skip_reason": lambda self, program, ctx: skip,
    })
    return cls()


def test_valid_order_is_accepted():
    PassManager([make_pass("a"), make_pass("b", ("a",)), make_pass("c", ("a", "b"))])


def test_cycle_is_rejected_naming_the_cycle():
    with pytest.raises(ValueError, match="cycle") as ei:
        PassManager([make_pass("a", ("c",)), make_pass("b", ("a",)), make_pass("c", ("b",)), make_pass("d")])
    msg = str(ei.value)
    for name in ("a", "b", "c"):
        assert re.search(rf"\b{name}\b", msg.split(":", 1)[1]), msg
    assert "d" not in msg.split(":", 1)[1]


def test_two_pass_cycle_is_rejected():
    with pytest.raises(ValueError, match=r"cycle.*(x -> y|y -> x)"):
        PassManager([make_pass("x", ("y",)), make_pass("y", ("x",))])


def test_missing_prerequisite_is_rejected():
    with pytest.raises(ValueError, match=r"'b' requires 'ghost', which is not in the pipeline"):
        PassManager([make_pass("a"), make_pass("b", ("ghost",))])


def test_prerequisite_scheduled_later_is_rejected():
    with pytest.raises(ValueError, match=r"'b' requires 'a', which is scheduled after it"):
        PassManager([make_pass("b", ("a",)), make_pass("a")])


def test_duplicate_pass_names_are_rejected():
    with pytest.raises(ValueError, match="unique"):
        PassManager([make_pass("a"), make_pass("b"), make_pass("a")])


# ----------------------------------------------------------------------------------------
# Report rows and skip_reason on a small traced graph


class _Toy(torch.nn.Module):
    def forward(self, x):
        y = x * 1.0
        z = y + 0.0
        return torch.relu(z) * 2.0


class DropMulByOne(Pass):
    """Bypasses ``mul(x, 1.0)`` nodes (a real rewrite, so node counts change)."""

    name = "drop_mul_by_one"

    def run_graph(self, gm, phase, ctx):
        n = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is operator.mul and node.args[1] == 1.0:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                n += 1
        return PassResult(matches=n, note=f"{n} dropped")


def toy_program() -> Program:
    return Program({"main": torch.fx.symbolic_trace(_Toy())})


def test_report_rows_record_time_matches_and_node_counts():
    program = toy_program()
    before = program.node_count()
    report = PassManager([DropMulByOne()]).run(program, PassContext(info=None))
    (rec,) = report.records
    assert (rec.index, rec.name, rec.status) == (1, "drop_mul_by_one", "ran")
    assert rec.matches == 1 and rec.note == "1 dropped"
    assert rec.nodes_before == before and rec.nodes_after == before - 1 == program.node_count()
    assert rec.time_ms >= 0.0 and rec.max_drift is None
    md = report.as_markdown()
    assert "| 01 | drop_mul_by_one | ran |" in md
    assert f"| 1 | {before} | {before - 1} | 1 dropped |" in md
    assert "max drift" not in md  # no verify column without a probe
    x = torch.randn(5)
    torch.testing.assert_close(program.main(x), torch.relu(x) * 2.0)


def test_skip_reason_produces_a_skipped_row_and_does_not_run():
    calls: list[str] = []
    program = toy_program()
    before = program.node_count()
    passes = [make_pass("first", calls=calls), make_pass("needs_cuda", skip="no CUDA device", calls=calls),
              DropMulByOne()]
    report = PassManager(passes).run(program, PassContext(info=None))
    assert calls == ["first"]
    skipped = report.records[1]
    assert (skipped.name, skipped.status, skipped.note) == ("needs_cuda", "skipped", "no CUDA device")
    assert skipped.time_ms == 0.0 and skipped.matches == 0
    assert skipped.nodes_before == skipped.nodes_after == before
    assert "| 02 | needs_cuda | skipped | 0.0 | 0 |" in report.as_markdown()
    assert report.records[2].status == "ran" and report.records[2].matches == 1


def test_dump_includes_a_trailing_skipped_pass(tmp_path):
    """index.md must list every pass, even when the last one is skipped."""
    program = toy_program()
    passes = [DropMulByOne(), make_pass("needs_cuda", skip="no CUDA device")]
    report = PassManager(passes, dump_dir=str(tmp_path)).run(program, PassContext(info=None))
    index = (tmp_path / "index.md").read_text()
    assert "needs_cuda | skipped" in index
    assert report.as_markdown() in index
    for stem in ("00_captured", "01_drop_mul_by_one", "02_needs_cuda"):
        assert (tmp_path / f"{stem}.py").exists() and (tmp_path / f"{stem}.txt").exists()


# ----------------------------------------------------------------------------------------
# Dumps from optimize()


def _table_rows(markdown: str) -> list[list[str]]:
    """Cells of each data row (``| 01 | ...``) of a report table."""
    rows = []
    for line in markdown.splitlines():
        if re.match(r"\|\s*\d\d\s*\|", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _check_dump_dir(path: str, opt) -> None:
    names = [r.name for r in opt.pass_report.records]
    assert names[0] == "attention_to_paged" and names[-1] == "wrap_cuda_graphs" and "fuse_projections" in names
    stems = ["00_captured"] + [f"{i:02d}_{n}" for i, n in enumerate(names, start=1)]
    expected = {f"{s}{ext}" for s in stems for ext in (".py", ".txt")} | {"index.md"}
    assert expected <= set(os.listdir(path))
    for s in stems:
        code = open(os.path.join(path, s + ".py")).read()
        assert "def forward" in code
        table = open(os.path.join(path, s + ".txt")).read()
        assert "shape:dtype" in table
        assert re.search(r"float32\[1, s\d+", table), f"{s}.txt has no shape:dtype like float32[1, s..."
        assert re.search(r"int64\[1, s\d+\]", table)  # the input_ids placeholder
    index = open(os.path.join(path, "index.md")).read()
    index_rows = _table_rows(index)
    report_rows = _table_rows(opt.report())
    assert index_rows == report_rows
    assert [r[1] for r in index_rows] == names
    for row, rec in zip(index_rows, opt.pass_report.records):
        assert row[2] == rec.status
        assert int(row[4]) == rec.matches
        assert (int(row[5]), int(row[6])) == (rec.nodes_before, rec.nodes_after)


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dump"))
    model = tiny_llama()
    opt = dc.optimize(model, dump_dir=path, num_kv_blocks=16, block_size=4)
    return path, opt, model


def test_dump_dir_writes_every_pass_and_index(dumped):
    path, opt, _ = dumped
    _check_dump_dir(path, opt)


def test_dump_shows_the_paged_attention_rewrite(dumped):
    path, _, _ = dumped
    captured = open(os.path.join(path, "00_captured.txt")).read()
    rewritten = open(os.path.join(path, "01_attention_to_paged.txt")).read()
    assert captured.count("aten.scaled_dot_product_attention") == NUM_LAYERS
    assert "devin.paged_attention" not in captured
    assert rewritten.count("devin.paged_attention") == NUM_LAYERS
    # the new nodes carry shape:dtype too: [T, Hq, D]
    assert re.search(r"paged_attention\S*\s+call_function\s+float32\[s\d+, 4, 16\]", rewritten)
    for mask_op in ("aten.diff", "aten.cumsum", "aten.scaled_dot_product_attention"):
        assert mask_op not in rewritten


def test_attention_to_paged_rewrites_every_layer_and_drops_the_mask(dumped):
    _, opt, _ = dumped
    rec = opt.pass_report.records[0]
    assert rec.name == "attention_to_paged" and rec.matches == NUM_LAYERS == opt.info.num_layers
    for gm in opt.program.graphs.values():
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        paged = [n for n in gm.graph.nodes if n.target is torch.ops.devin.paged_attention.default]
        assert [n.args[3] for n in paged] == list(range(NUM_LAYERS))  # one call per layer, in order
        forbidden = {aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default,
                     aten.diff.default, aten.cumsum.default, aten.__and__.Tensor, aten.le.Tensor, aten.eq.Tensor,
                     aten.arange.default, aten.arange.start, aten.new_ones.default}
        left = sorted({str(t) for t in targets if t in forbidden})
        assert not left, f"mask / attention nodes survived: {left}"


def test_dump_env_var_and_verify(tmp_path):
    path = str(tmp_path / "env_dump")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEVIN_COMPILE_DUMP", path)
        opt = dc.optimize(tiny_llama(seed=1), verify=True, num_kv_blocks=16, block_size=4)
    _check_dump_dir(path, opt)
    # verify: one drift per pass, all tiny, no drifting pass named
    ran = [r for r in opt.pass_report.records if r.status == "ran"]
    assert len(ran) >= 6 and all(r.max_drift is None for r in opt.pass_report.records if r.status != "ran")
    drifts = [r.max_drift for r in ran]
    assert all(d is not None for d in drifts)
    assert max(drifts) < 1e-4
    assert opt.pass_report.first_drift is None
    assert "max drift" in opt.report()
    assert "max drift" in open(os.path.join(path, "index.md")).read()


# ----------------------------------------------------------------------------------------
# verify names the first drifting pass


class PerturbLogits(Pass):
    """A deliberately broken pass: scales the graph's logits output by 1.01."""

    name = "perturb_logits"

    def run_graph(self, gm, phase, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        logits = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
        with gm.graph.inserting_before(out):
            scaled = add_call(gm.graph, aten.mul.Tensor, (logits, 1.01), like=logits)
        out.replace_input_with(logits, scaled)
        return PassResult(matches=1)


def test_verify_names_the_first_drifting_pass():
    model = tiny_llama(seed=2)
    gm, info = capture(model)
    program = Program({"main": gm})
    ctx = PassContext(info=info, config=OptimizeConfig())
    pm = PassManager([AttentionToPaged(), PerturbLogits(), Cleanup()], probe=make_probe(info, info.device))
    report = pm.run(program, ctx)
    assert report.first_drift == "perturb_logits"
    drift = {r.name: r.max_drift for r in report.records}
    assert drift["attention_to_paged"] < 1e-4
    assert drift["perturb_logits"] > 1e-3
    assert drift["cleanup"] > 1e-3  # later passes keep the drift, but are not blamed
    assert "First pass whose output drifts: **perturb_logits**" in report.as_markdown()


# ----------------------------------------------------------------------------------------
# An attention layer that matches no pattern


def _unrecognisable_attention(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Mixes tokens without softmax(QKᵀ)V or SDPA (a gated running mean)."""
    q = self.q_proj(hidden_states)
    denom = torch.arange(1, q.shape[1] + 1, device=q.device, dtype=q.dtype)[None, :, None]
    mixed = torch.cumsum(q, dim=1) / denom * torch.sigmoid(q)
    return self.o_proj(mixed), None


def test_unrecognised_attention_layer_raises_pass_error_naming_it():
    model = tiny_llama(seed=3)
    attn = model.model.layers[1].self_attn
    attn.forward = types.MethodType(_unrecognisable_attention, attn)
    with pytest.raises(PassError) as ei:
        dc.optimize(model, num_kv_blocks=16, block_size=4)
    msg = str(ei.value)
    assert "layers.1.self_attn" in msg
    assert "layers.0" not in msg and "layers.2" not in msg
    assert f"{NUM_LAYERS - 1} of {NUM_LAYERS}" in msg


def test_pass_that_runs_graphs_sees_earlier_rewrites():
    """Graphs are recompiled lazily: a pass with ``runs_graphs`` executes the rewritten code,
    and after the run the program's code matches its nodes."""
    seen = []

    class RunsIt(Pass):
        name = "runs_it"
        runs_graphs = True

        def run_graph(self, gm, phase, ctx):
            seen.append(gm.code)
            return PassResult()

    program = toy_program()
    PassManager([DropMulByOne(), RunsIt()]).run(program, PassContext(info=None))
    assert "* 1.0" not in seen[0] and "+ 0.0" in seen[0]  # the rewrite is in the code it ran
    assert "* 1.0" not in program.main.code
