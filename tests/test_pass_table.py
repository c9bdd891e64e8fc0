"""The pass table: same passes, order and conditions as the if-chain it replaced; passes import
only their floors; scratch steps lay sequences out as the probe and compile_decode did; pass
notes count the nodes a pass added and removed truthfully."""
import ast
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile as dc
from devin_compile.capture import ModelInfo
from devin_compile.config import OptimizeConfig, PassOptions
from devin_compile.passes import (AssignPrecision, AttentionToPaged, Cleanup, CompileDecode, FuseAddRMSNorm, FuseAttentionInputs,
                                  FuseMoEExperts, FuseProjections, FuseRMSNorm, FuseRotary, FuseSiluMul, InsertKVPrune,
                                  OffloadEmbeddings, PackGemmLinears, PrepackOneDNNExperts, PrepackOneDNNLinears, SplitPhases,
                                  UpcastLinear, WrapCudaGraphs, default_passes)
from devin_compile.passes.table import PASS_TABLE, STAGES, Flags, table_markdown
from devin_compile.pipeline import PassContext, PassError, PassManager, Program
from devin_compile.quant.config import QuantConfig

ROOT = Path(__file__).resolve().parents[1]


def _if_chain(config, offload_roles=frozenset(), quant=None) -> list:
    """passes/__init__.py's default_passes before the pass table (the reference)."""
    passes = [AttentionToPaged()]
    if config.passes.fuse_rms_norm:
        passes.append(FuseRMSNorm())
    if config.passes.fuse_rotary:
        passes.append(FuseRotary())
    if config.passes.fuse_projections:
        passes.append(FuseProjections())
        if config.passes.fuse_silu_mul:
            passes.append(FuseSiluMul())
    if quant is not None:
        passes.append(AssignPrecision(*quant))
    if config.passes.split_phases:
        passes.append(SplitPhases(config.decode_buckets))
    if getattr(config, "kv_prune", None) is not None:
        passes.append(InsertKVPrune())
    if offload_roles:
        passes.append(OffloadEmbeddings(offload_roles))
    if config.passes.pack_linears:
        passes.append(PackGemmLinears())
    if config.passes.prepack_linear:
        passes.append(PrepackOneDNNLinears())
    if config.passes.fuse_moe_experts:
        passes.append(FuseMoEExperts())
    if config.passes.prepack_linear:
        passes.append(PrepackOneDNNExperts())
    if config.passes.upcast_linear:
        passes.append(UpcastLinear())
    passes.append(Cleanup())
    if config.passes.fuse_rotary and config.passes.fuse_attention_inputs:
        passes.append(FuseAttentionInputs())
    if config.passes.fuse_rms_norm and config.passes.fuse_add_rms_norm:  # the row added after the if-chain
        passes.append(FuseAddRMSNorm())
    if config.compile_decode:
        passes.append(CompileDecode(config.decode_buckets, config.scheduler.max_num_seqs,
                                    getattr(config, "compile_decode_options", None)))
    if config.passes.split_phases and config.passes.cuda_graphs:  # the row added after the if-chain
        rows = config.scheduler.max_num_seqs
        if config.speculative is not None:
            rows = max(rows, config.speculative.max_verify_tokens)
        passes.append(WrapCudaGraphs(rows))
    return passes


def _state(p) -> tuple:
    """A pass's name and constructor state (what the table must build the same)."""
    state = {k: v for k, v in vars(p).items() if k != "result"}
    return p.name, type(p), sorted(state.items(), key=lambda kv: kv[0]), id(getattr(p, "result", None))


QUANT = (object(), QuantConfig())
CASES = [
    ({}, frozenset(), None),
    ({"cuda_graphs": False}, frozenset(), None),
    ({"speculative": "ngram", "max_num_seqs": 4}, frozenset(), None),  # verify rows reach max_verify_tokens
    ({"fuse_projections": False}, frozenset(), None),  # fuse_silu_mul only with fuse_projections
    ({"fuse_silu_mul": False}, frozenset(), None),
    ({"fuse_add_rms_norm": False}, frozenset(), None),
    ({"fuse_rotary": False}, frozenset(), None),  # fuse_attention_inputs only with fuse_rotary
    ({"fuse_attention_inputs": False, "fuse_rms_norm": False}, frozenset(), None),
    ({"split_phases": False, "prepack_linear": False, "upcast_linear": False}, frozenset(), None),
    ({"compile_decode": True, "decode_buckets": (1, 4), "max_num_seqs": 2,
      "compile_decode_options": {"cpp_wrapper": True}}, frozenset(), None),
    ({"kv_prune": True, "decode_buckets": (2, 8)}, frozenset({"embed_tokens"}), None),
    ({}, frozenset({"embed_tokens", "lm_head"}), QUANT),  # assign_precision only with quant
    ({"fuse_projections": False, "fuse_rotary": False, "compile_decode": True}, frozenset(), QUANT),
]


@pytest.mark.parametrize("options,roles,quant", CASES)
def test_table_equals_the_old_if_chain(options, roles, quant):
    config = OptimizeConfig.from_kwargs(options)
    got = default_passes(config, set(roles), quant)
    want = _if_chain(config, set(roles), quant)
    assert [_state(p) for p in got] == [_state(p) for p in want]
    PassManager(got)  # requirements hold in every case
    if quant is not None:
        ap = next(p for p in got if p.name == "assign_precision")
        assert ap.result is quant[0] and ap.qconfig is quant[1]


def test_table_rows_are_ordered_by_stage_and_documented():
    names = [spec.name for spec in PASS_TABLE]
    assert len(set(names)) == len(names)
    stages = [STAGES.index(spec.stage) for spec in PASS_TABLE]
    assert stages == sorted(stages)
    for spec in PASS_TABLE:
        for flag in spec.enabled_by.names if isinstance(spec.enabled_by, Flags) else ():
            assert isinstance(getattr(PassOptions(), flag), bool), flag
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert table_markdown() in doc  # docs/architecture.md shows the table as it is


def _imports(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` (in ``package``) imports, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_passes_import_neither_backends_nor_runtime():
    files = sorted((ROOT / "devin_compile" / "passes").rglob("*.py"))
    assert files
    package = {f: ".".join(["devin_compile", *f.relative_to(ROOT / "devin_compile").parent.parts]) for f in files}
    bad = {f.name: sorted(m for m in _imports(f, package[f])
                          if m.startswith(("devin_compile.backends", "devin_compile.runtime")))
           for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def _info(**kw) -> ModelInfo:
    base = dict(model_type="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64,
                max_model_len=64, dtype=torch.float32, device=torch.device("cpu"), eos_token_ids=[2])
    return ModelInfo(**{**base, **kw})


def test_scratch_step_layout():
    from devin_compile.runtime.scratch import scratch_step, scratch_steps
    from devin_compile.step import current_context

    info = _info()
    with scratch_step(info, "cpu", [12]) as ctx:  # the probe's one sequence
        assert current_context() is ctx
        assert ctx.attn.block_tables_host == [[0]] and ctx.attn.slot_mapping.tolist() == list(range(12))
        assert ctx.attn.seq_lens_host == [12] and ctx.kv_cache.layer(0)[0].shape[:2] == (1, 16)
    with scratch_steps(info)([1, 1, 1]) as ctx:  # compile_decode's warm-up at batch 3
        assert ctx.attn.block_tables_host == [[0], [1], [2]] and ctx.attn.slot_mapping.tolist() == [0, 16, 32]
        assert ctx.attn.is_pure_decode and ctx.kv_cache.layer(1)[0].shape[0] == 3
    with scratch_step(info, "cpu", [17, 2], block_size=16) as ctx:
        assert ctx.attn.block_tables_host == [[0, 1], [2]]
        assert ctx.attn.slot_mapping.tolist() == list(range(17)) + [32, 33]


def test_compile_decode_needs_a_scratch_step():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    program = Program({"prefill": gm, "decode": gm})
    with pytest.raises(PassError, match="scratch_step"):
        CompileDecode((1,), 4).run(program, PassContext(info=_info()))


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def test_pass_notes_count_added_and_removed_nodes():
    """'A nodes added, R removed' (summed over graphs) equals the change in node count, and
    cleanup's 'N nodes removed' is its drop in node count."""
    report = dc.optimize(_tiny(), num_kv_blocks=16, block_size=4).pass_report
    checked = 0
    for rec in report.records:
        delta = [(int(a), int(r)) for a, r in re.findall(r"(\d+) nodes added, (\d+) removed", rec.note)]
        if delta:
            assert sum(a - r for a, r in delta) == rec.nodes_after - rec.nodes_before, rec
            checked += 1
        if rec.name == "cleanup":
            removed = int(re.search(r"(\d+) nodes removed", rec.note).group(1))
            assert removed == rec.nodes_before - rec.nodes_after, rec
            checked += 1
    grew = next(r for r in report.records if r.name == "fuse_rotary")
    assert grew.nodes_after > grew.nodes_before and "nodes added" in grew.note  # the note once said only "removed"
    assert checked >= 7
