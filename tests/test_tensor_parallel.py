"""Tensor parallelism (issue 40): two gloo ranks on this CPU give the tokens and logits of one process.

Two worker processes (``tp_worker.py``, started like torchrun: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT,
a free port, one thread each, a bounded wait so a hang fails) optimize tiny seeded fp32 models with
``tensor_parallel=2``; the test runs the same workload in one process and compares. The pass itself
is also checked without a process group (its collectives are only traced, never run), and bad input
fails with one ``ValueError`` before any weight moves.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import devin_compile as dc
from devin_compile.capture import capture, model_info
from devin_compile.config.tensor_parallel import TensorParallelSpec, head_shard
from devin_compile.graph_utils import add_call
from devin_compile.passes import AttentionToPaged, ShardTensorParallel
from devin_compile.pipeline import PassContext, PassError, PassManager, Program

from devin_compile.cli.launch import _die_with_parent
from tp_worker import CASES, build, run_case, workload

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "tp_worker.py"
TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, *args: str, timeout_s: float = TIMEOUT_S, env: dict | None = None) -> list[dict]:
    """Start two ranks of ``tp_worker.py`` like torchrun (env://, a free port on 127.0.0.1, one thread each,
    ``env`` added); each rank's results once both exit 0 within ``timeout_s`` (a hang fails the test, no
    process left)."""
    port = str(_free_port())
    procs = []
    extra = env or {}
    for rank in range(2):
        env = {**os.environ, **extra, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      preexec_fn=_die_with_parent))  # no rank outlives a killed pytest
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"tensor-parallel ranks did not finish in {timeout_s} s (a hang)")
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return [json.loads((tmp / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results for every case of ``tp_worker.CASES`` (one launch of two processes)."""
    return launch(tmp_path_factory.mktemp("tp"), *CASES)


def assert_matches(ref: dict, ranks: list[dict], case: str, atol: float = 1e-4) -> None:
    for rank, results in enumerate(ranks):
        got = results[case]
        assert got["tokens"] == ref["tokens"], f"rank {rank}"
        torch.testing.assert_close(torch.tensor(got["logits"]), torch.tensor(ref["logits"]), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(ranks, case):
    """Greedy tokens identical, logits within fp32 summation-order tolerance, on both ranks (mixtral: with
    each rank's split experts still fused into devin::moe_experts, as in one process)."""
    ref = workload(dc.optimize(build(case), num_kv_blocks=32), case)
    assert_matches(ref, ranks, case)
    assert [r[case]["experts_note"] for r in ranks] == [ref["experts_note"]] * 2
    if case == "mixtral":
        assert "prefill: 2 MoE expert blocks fused" in ref["experts_note"]
    tied = "tied embedding reads the packed head"  # pack_gemm_linears packs the rank's head shard as one process's
    assert [tied in r[case]["pack_note"] for r in ranks] == [tied in ref["pack_note"]] * 2


@pytest.mark.slow
def test_smollm2_two_ranks_match_one_process(tmp_path):
    """The real SmolLM2-135M (9 query heads in 3 GQA groups): rank 0 holds 2 groups, rank 1 one; greedy
    tokens identical to one process, logits within fp32 summation-order tolerance."""
    results = launch(tmp_path, "smollm2")
    ref = workload(dc.optimize(build("smollm2"), num_kv_blocks=32), "smollm2")
    assert_matches(ref, results, "smollm2", atol=2e-4)
    assert [r["smollm2"]["kv_heads"] for r in results] == [2, 1]


FEATURE_RUNS = ["llama@prefix", "llama@preempt", "llama@ngram", "llama_9x3@head", "llama_9x3@tiers",
                "llama_kv1@tiers_wt"]


@pytest.fixture(scope="module")
def feature_ranks(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("tp_features"), *FEATURE_RUNS)


@pytest.mark.parametrize("run", FEATURE_RUNS)
def test_runtime_features_match_one_process(feature_ranks, run):
    """Prefix caching, preemption (a 7-block pool for three 4-block sequences), speculative decoding
    (n-gram; a 1-layer head draft that runs on rank 0 only) and KV tiers (a host tier filled on eviction,
    or written through; whole blocks gathered from both ranks, loaded blocks scattered back; uneven heads
    and a replicated KV head) at tensor_parallel=2: greedy tokens identical to one process with the same
    options, and the feature really ran (hits, preemptions, drafts, blocks loaded from the tier)."""
    ref = run_case(run, 1)
    feature = run.partition("@")[2]
    counter = {"prefix": "prefix_hit_tokens", "preempt": "preemptions", "ngram": "proposed", "head": "proposed",
               "tiers": "tier_loaded", "tiers_wt": "tier_loaded"}[feature]
    assert ref[counter] > 0
    for rank, results in enumerate(feature_ranks):
        assert results[run]["tokens"] == ref["tokens"], f"rank {rank}"
    assert feature_ranks[0][run] == ref  # rank 0 schedules: the same hits, preemptions and acceptance


_VOCAB = re.compile(r"(embed_tokens|lm_head)\.(weight|bias)$")


def _rank_bytes(name: str, p: torch.Tensor, heads, cfg) -> int:
    """The bytes of parameter ``name`` on the rank holding ``heads``: its heads' share of q/k/v/o, half of an
    MLP or expert weight, ⌈V/2⌉ rows of a vocabulary table (the head, the embedding; padded)."""
    if _VOCAB.search(name):
        return p.nbytes // p.shape[0] * -(-p.shape[0] // 2)
    share = {"q": len(heads.q) / cfg.num_attention_heads, "o": len(heads.q) / cfg.num_attention_heads,
             "k": len(heads.kv) / cfg.num_key_value_heads, "v": len(heads.kv) / cfg.num_key_value_heads}
    return int(p.nbytes * share.get(name.split(".")[-2][0], 0.5))


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_and_kv_heads_per_rank(ranks, case):
    """Each rank holds its heads' share of q/k/v/o and 1/2 of the MLP (of every expert's, for mixtral), plus
    whole copies of KV heads it shares (1 KV head, 2 ranks), and ⌈V/2⌉ rows of the logits linear and the
    token embedding (one table when tied, counted once); its KV pool holds its own KV heads only."""
    model = build(case)
    cfg = model.config
    split = re.compile(r"_proj(\.weight|\.bias)?$|" + _VOCAB.pattern)  # q/k/v/o, gate/up/down, experts, vocab
    params = [(n, p) for n, p in model.named_parameters() if split.search(n)]  # a tied table once
    full = sum(p.nbytes for _, p in params)
    vocab = [p for n, p in params if _VOCAB.search(n)]
    assert len(vocab) == (1 if cfg.tie_word_embeddings else 2)
    for rank, results in enumerate(ranks):
        heads = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, 2, rank)
        expected = sum(_rank_bytes(n, p, heads, cfg) for n, p in params)
        got = results[case]
        local, total = map(int, re.search(r"split weights (\d+) of (\d+) bytes", got["note"]).groups())
        assert (local, total) == (expected, full)
        assert got["kv_heads"] == len(heads.kv)
        if heads.kv.stop - heads.kv.start == cfg.num_key_value_heads / 2:  # even split: about half of them
            assert 0.49 < local / full < 0.51
        assert f"{-(-cfg.vocab_size // 2)} of {cfg.vocab_size} per rank" in got["note"]
        assert ("tied: one shard" in got["note"]) == cfg.tie_word_embeddings


def _sharded(case: str, rank: int):
    model = build(case)
    gm, info = capture(model, info=model_info(model))
    program = Program({"main": gm})
    spec = TensorParallelSpec(2, rank, "tp-test")
    PassManager([AttentionToPaged(), ShardTensorParallel(spec)]).run(program, PassContext(info=info))
    return model, program.main


def test_pass_splits_heads_and_sums_row_parallel_outputs():
    """Rank 0's and rank 1's q rows and o columns put together are the model's; one all_reduce per
    row-parallel linear (and the embedding's); paged_attention sees 2 of 4 query heads and 1 of 2 KV heads."""
    parts = [_sharded("llama", rank) for rank in range(2)]
    model = parts[0][0]
    for rank, (_, gm) in enumerate(parts):
        reduces = [n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.all_reduce.default]
        assert len(reduces) == 2 * model.config.num_hidden_layers + 1  # + the vocab-parallel embedding's
        assert all(n.args[2] == "tp-test" for n in reduces)
        attn = [n for n in gm.graph.nodes if n.target == torch.ops.devin.paged_attention.default]
        assert [tuple(a.meta["val"].shape[1:]) for a in attn[0].args[:3]] == [(2, 16), (1, 16), (1, 16)]
    layer = model.model.layers[0]
    weights = [dict(gm.named_parameters()) for _, gm in parts]
    q = [w[k] for w in weights for k in w if k.endswith("layers.0.self_attn.q_proj.weight")]
    o = [w[k] for w in weights for k in w if k.endswith("layers.0.self_attn.o_proj.weight")]
    torch.testing.assert_close(torch.cat(q, 0), layer.self_attn.q_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(o, 1), layer.self_attn.o_proj.weight, rtol=0, atol=0)


def test_pass_splits_every_expert_and_keeps_the_router():
    """Mixtral: each rank keeps every expert's gate and up rows of its half of the intermediate features
    (gate then up, as the graph chunks them) and the same down columns; the router stays whole; one
    all_reduce per attention output, one per expert block (and the embedding's)."""
    parts = [_sharded("mixtral", rank) for rank in range(2)]
    model = parts[0][0]
    experts = model.model.layers[0].mlp.experts
    f = experts.down_proj.shape[2]
    weights = [dict(gm.named_parameters()) | dict(gm.named_buffers()) for _, gm in parts]
    get = [lambda w, end=end: next(w[k] for k in w if k.endswith(end)) for end in (
        "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj", "layers.0.mlp.gate.weight")]
    gate_up = [get[0](w) for w in weights]
    for half in (0, 1):  # gate rows, then up rows
        got = torch.cat([g[:, half * f // 2:(half + 1) * f // 2] for g in gate_up], 1)
        torch.testing.assert_close(got, experts.gate_up_proj[:, half * f:(half + 1) * f], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([get[1](w) for w in weights], 2), experts.down_proj, rtol=0, atol=0)
    for w in weights:
        torch.testing.assert_close(get[2](w), model.model.layers[0].mlp.gate.weight, rtol=0, atol=0)
    for _, gm in parts:
        reduces = [n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.all_reduce.default]
        assert len(reduces) == 2 * model.config.num_hidden_layers + 1  # + the vocab-parallel embedding's


@pytest.mark.parametrize("case", ["llama_tied", "llama_v251"])
def test_pass_splits_the_vocabulary(case):
    """The logits linear and the token embedding keep ⌈251/2⌉ = 126 rows per rank (rank 1's 125 and one zero
    row), which put together are the model's tables; a tied table is one parameter on each rank that the
    head and the lookup both read; one all_gather (the logits) and one more all_reduce (the embedding)."""
    parts = [_sharded(case, rank) for rank in range(2)]
    model = parts[0][0]
    c10d = torch.ops._c10d_functional
    aten = torch.ops.aten
    readers = {"embed": (model.model.embed_tokens.weight, lambda n: n.target == aten.embedding.default and n.args[0]),
               "head": (model.lm_head.weight, lambda n: n.target == aten.linear.default and n.args[1].target.endswith(
                   "lm_head.weight") and n.args[1])}
    for table, weight_of in readers.values():
        shards = [gm.get_parameter(next(filter(None, map(weight_of, gm.graph.nodes))).target) for _, gm in parts]
        assert [tuple(t.shape) for t in shards] == [(126, 64)] * 2
        torch.testing.assert_close(torch.cat(shards)[:251], table, rtol=0, atol=0)
        assert not shards[1][125:].any()
    for _, gm in parts:
        params = [n for n, p in gm.named_parameters() if p.shape[0] == 126]
        assert len(params) == (1 if model.config.tie_word_embeddings else 2)
        gathers = [n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default]
        reduces = [n for n in gm.graph.nodes if n.target == c10d.all_reduce.default]
        assert len(gathers) == 1 and len(reduces) == 2 * model.config.num_hidden_layers + 1
        assert tuple(gathers[0].meta["val"].shape)[-1] == 126
        assert [tuple(n.meta["val"].shape)[-1] for n in gm.graph.output_node().all_input_nodes] == [251]


def test_pass_refuses_a_vocabulary_table_read_elsewhere():
    """A tied table that another node reads too (here a sum of it added to the logits) cannot be split by rows
    for the head and the embedding alone: a PassError naming the reader, before any weight is split."""
    model = build("llama_tied")
    gm, info = capture(model, info=model_info(model))
    program = Program({"main": gm})
    PassManager([AttentionToPaged()]).run(program, PassContext(info=info))
    gm = program.main
    table = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("lm_head.weight"))
    logits = gm.graph.output_node().all_input_nodes[0]
    with gm.graph.inserting_after(logits):
        total = add_call(gm.graph, torch.ops.aten.sum.default, (table,))
    with gm.graph.inserting_after(total):
        shifted = add_call(gm.graph, torch.ops.aten.add.Tensor, (logits, total))
    logits.replace_all_uses_with(shifted, delete_user_cb=lambda u: u is not shifted)
    shapes = {n: tuple(p.shape) for n, p in gm.named_parameters()}
    with pytest.raises(PassError, match=r"sum_default \(aten\.sum\.default\) reads m\.lm_head\.weight, the vocabulary "
                                        r"table that shard_tensor_parallel splits by rows"):
        ShardTensorParallel(TensorParallelSpec(2, 0, "tp-test")).run_graph(gm, "main", PassContext(info=info))
    assert {n: tuple(p.shape) for n, p in gm.named_parameters()} == shapes


def test_pass_names_a_fused_qkv_layer():
    """Phi-3 projects q, k, v with one linear: a PassError naming the layer, not a silent replica, raised
    while planning, before any weight is split."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                       pad_token_id=0)).eval()
    gm, info = capture(model, info=model_info(model))
    program = Program({"main": gm})
    manager = PassManager([AttentionToPaged(), ShardTensorParallel(TensorParallelSpec(2, 0, "tp-test"))])
    shapes = {n: tuple(p.shape) for n, p in gm.named_parameters()}
    with pytest.raises(PassError, match=r"layers\.0\.self_attn: query, key and value come from one fused linear"):
        manager.run(program, PassContext(info=info))
    assert {n: tuple(p.shape) for n, p in program.main.named_parameters()} == shapes


@pytest.mark.parametrize("options, env, message", [
    (dict(tensor_parallel=3), {}, "tensor_parallel=3 does not split the model's 4 query heads over its 2 KV heads"),
    (dict(tensor_parallel=2), {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "tensor_parallel=2 but the process group has 1 ranks"),
    (dict(tensor_parallel=2), {}, r"launch with `torchrun --nproc-per-node 2`"),
    (dict(tensor_parallel=2, verify=True), {}, "tensor_parallel=2 with verify= is not supported yet"),
    # offload_embeddings would move the vocab-parallel head and embedding: refused with tensor parallelism
    (dict(tensor_parallel=2, offload_layers=["embed_tokens", "lm_head"]), {},
     "tensor_parallel=2 with offload_layers= is not supported yet"),
    (dict(tensor_parallel=0), {}, "tensor_parallel=0 must be an integer >= 1"),
])
def test_bad_input_fails_before_any_weight_moves(monkeypatch, options, env, message):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    model = build("llama")
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        dc.optimize(model, dtype="bf16", **options)
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before
    assert not dist.is_initialized()


def test_shared_experts_are_refused_by_name():
    """Qwen2-MoE's shared expert has a gate linear the pass does not split: refused before capture."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                               moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               shared_expert_intermediate_size=64)).eval()
    with pytest.raises(ValueError, match=r"mixture-of-experts models with shared experts "
                                         r"\(shared_expert_intermediate_size=64\) yet; use tensor_parallel=1"):
        dc.optimize(model, tensor_parallel=2)
    assert not dist.is_initialized()


def test_experts_that_do_not_split_are_refused_before_any_weight_moves():
    """Every expert is split over the ranks by its intermediate features: tp must divide them."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=90, num_local_experts=4,
                                             num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2)).eval()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"tensor_parallel=4 does not divide the experts' intermediate size 90"):
        dc.optimize(model, tensor_parallel=4, dtype="bf16")
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert not dist.is_initialized()


@pytest.mark.parametrize("hq, hkv, tp, expected", [
    (4, 2, 2, [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]),
    (4, 1, 2, [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]),  # the KV head replicated
    (9, 3, 2, [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]),  # SmolLM2: whole groups, 2 + 1
    (12, 4, 3, [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3)), (range(9, 12), range(3, 4))]),
])
def test_heads_go_to_ranks_in_whole_groups(hq, hkv, tp, expected):
    """Every query head on exactly one rank, with the KV head it reads."""
    shards = [head_shard(hq, hkv, tp, r) for r in range(tp)]
    assert [(s.q, s.kv) for s in shards] == expected
    for s in shards:
        assert all(h // (hq // hkv) in s.kv for h in s.q)
