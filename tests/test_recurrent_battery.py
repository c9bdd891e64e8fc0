"""Families issue 42 added, under the runtime's hard paths: recurrent layers over the state pool (Mamba2 and
Mamba mixers, gated DeltaNet, RG-LRU, short convolutions) and the attention variants (gpt_oss's sinks,
llama4_text's chunked local attention, xglm's other spelling).

Each family test_families.py checks (teacher-forced logits, a padded batch, greedy parity) here also
generates for prompts of 5, 19 and 37 tokens at once with block_size 4 and 16-token steps: prompts
prefilled in chunks that continue from the stored KV and conv/SSM states, decode rows mixed with prefill
chunks of other sequences in one step, and a KV pool too small for all three, so the scheduler preempts
(freeing the state slot) and recomputes from scratch, on the CPU default backend and the torch reference.
Greedy tokens must equal HF eager's and preemption must really have happened; afterwards every state slot
is free again.
"""
from __future__ import annotations


import pytest
import torch

from conftest import FAMILIES
from devin_compile import optimize

PROMPT_LENS = (5, 19, 37)
NEW_TOKENS = [32, 40, 48]
NUM_KV_BLOCKS = 26  # 26 x 4 slots: the longest request (85 tokens, 22 blocks) fits alone, not all three
RECURRENT = [name for name in ("bamba", "granitemoehybrid", "nemotron_h", "mamba2", "mamba", "falcon_mamba", "jamba",
                               "qwen3_next", "recurrent_gemma", "lfm2", "falcon_h1", "falcon_h1_norm")
             if name in FAMILIES]
ATTENTION = [name for name in ("gpt_oss", "llama4_text", "xglm") if name in FAMILIES]  # sinks, chunks, spelling

pytestmark = pytest.mark.filterwarnings("ignore")  # HF and torch notices of the tiny configs


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(42)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("backend", ["cpu_sdpa", "torch_reference"])
@pytest.mark.parametrize("family", RECURRENT + ATTENTION)
def test_preempted_chunked_batch_matches_hf(family, backend, tiny_model, hf_reference):
    fam = FAMILIES[family]
    opt = optimize(tiny_model(family, fam.impls[-1]), attention_backend=backend, block_size=4,
                   num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16)
    assert opt.info.has_recurrent_state == (family in RECURRENT)
    prompts = _prompts()
    got = opt.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert opt.engine.metrics.preemptions > 0, "the pool was large enough for every request: nothing preempted"
    for prompt, n, tokens in zip(prompts, NEW_TOKENS, got):
        want = hf_reference.greedy(family, prompt, n)
        if tokens != want:
            first = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
            pytest.fail(f"{family}/{backend}: prompt of {len(prompt)} tokens diverges from HF greedy at new token "
                        f"{first}: {tokens[first:first + 5]} vs HF {want[first:first + 5]}")
    pool = opt.engine.runner.state_pool
    assert pool is None or pool.num_free == pool.num_slots, f"state slots leaked: {pool.owners()}"


@pytest.mark.parametrize("family", RECURRENT)
def test_graph_has_one_scan_per_mixer(family, tiny_model):
    """Each recurrent layer's stateful ops appear once per graph, numbered by layer."""
    fam = FAMILIES[family]
    opt = optimize(tiny_model(family, fam.impls[-1]), num_kv_blocks=16)
    n_mixers = len(opt.info.recurrent_modules)
    assert n_mixers > 0
    for name, gm in opt.program.graphs.items():
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("devin.")]
        ops = torch.ops.devin
        scans = [n for n in calls if n.target in (ops.mamba2_scan.default, ops.selective_scan.default,
                                                  ops.gated_delta_rule.default, ops.linear_recurrence.default)]
        scan_layers = [n.args[7] if n.target == ops.mamba2_scan.default else n.args[-1] for n in scans]
        mamba2 = {n.args[7] for n in scans if n.target == ops.mamba2_scan.default}  # its conv is inside its op
        conv_layers = sorted(n.args[3] for n in calls if n.target == ops.causal_conv1d.default)
        # one scan per layer, except short convolutions (LFM2): a conv window and no scan
        assert sorted(scan_layers) == list(range(n_mixers)) if family != "lfm2" else not scans, name
        assert conv_layers == sorted(set(range(n_mixers)) - mamba2), name


SPECULATIVE = [name for name in ("bamba", "mamba", "qwen3_next", "recurrent_gemma", "lfm2", "falcon_h1")
               if name in FAMILIES]


class _ScriptedProposer:
    """Proposes each request's true greedy continuation (HF's), its last proposal made wrong on every other call:
    verify steps then accept all proposals, or some and reject the rest, in a known mix."""

    name = "scripted"

    def __init__(self, want: dict[tuple, list[int]]) -> None:
        self.want, self.calls = want, 0

    def propose(self, requests):
        from devin_compile.runtime.speculative.proposer import Draft

        drafts = []
        for r in requests:
            self.calls += 1
            done = len(r.seq.output_ids)
            tokens = list(self.want[tuple(r.seq.prompt_ids)][done:done + r.num_tokens])
            if tokens and self.calls % 2:
                tokens[-1] = 3 + (tokens[-1] - 2) % 253  # another token (ids >= 3)
            drafts.append(Draft(tokens))
        return drafts

    def release(self, seq) -> None:
        pass


@pytest.mark.parametrize("family", SPECULATIVE)
def test_speculative_decoding_rolls_states_back(family, tiny_model, hf_reference):
    """Speculation over recurrent layers: verify steps whose proposals are all accepted (the state after them
    kept) and steps with rejections (the slot restored from its snapshot, the kept tokens recomputed), three
    requests batched with preemption forced; greedy tokens equal HF's and no state slot leaks."""
    fam = FAMILIES[family]
    opt = optimize(tiny_model(family, fam.impls[-1]), block_size=4, num_kv_blocks=NUM_KV_BLOCKS,
                   speculative=dict(method="ngram", num_tokens=3, adaptive=False))
    prompts = _prompts()
    want = {tuple(p): hf_reference.greedy(family, p, n) for p, n in zip(prompts, NEW_TOKENS)}
    opt.engine.set_proposer(_ScriptedProposer(want))
    got = opt.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, tokens in zip(prompts, got):
        if tokens != want[tuple(prompt)]:
            first = next(i for i, (a, b) in enumerate(zip(tokens, want[tuple(prompt)])) if a != b)
            pytest.fail(f"{family}: prompt of {len(prompt)} tokens diverges from HF greedy at new token {first}: "
                        f"{tokens[first:first + 5]} vs HF {want[tuple(prompt)][first:first + 5]}")
    spec = opt.engine.spec
    assert spec.totals.accepted > spec.totals.steps, "few proposals accepted: the kept-state path barely ran"
    assert spec.rollback.restored > 0, "no proposal was rejected: the rollback path was not exercised"
    assert opt.engine.metrics.preemptions > 0, "nothing preempted"
    pool = opt.engine.runner.state_pool
    assert pool.num_free == pool.num_slots, f"state slots leaked: {pool.owners()}"
