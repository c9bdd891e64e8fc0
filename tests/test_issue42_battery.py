"""The families issue 42 turned from refusals into compiled models, under the runtime's hard paths.

gpt_oss (attention sinks), llama4_text (chunked local attention beside NoPE global layers) and xglm
(query scaled before the product, sinusoidal positions) run test_families.py's battery there
(teacher-forced logits, a padded batch, greedy parity with HF eager). Here each one also generates
for prompts of 5, 19 and 37 tokens at once with block_size 4, 16-token steps (prompts prefilled in
chunks over cached context, decode rows mixed with prefill chunks) and a pool too small for all three
(so the scheduler preempts and recomputes), on the CPU default backend (cpu_sdpa: its masked SDPA
path for sinks, its windowed path for chunks) and on the torch reference: greedy tokens must equal
HF's, and preemption must really have happened.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import FAMILIES
from devin_compile import optimize

PROMPT_LENS = (5, 19, 37)
NEW_TOKENS = [32, 40, 48]
NUM_KV_BLOCKS = 26  # 26 x 4 slots: the longest request (85 tokens, 22 blocks) fits alone, not all three
ISSUE42 = [name for name in ("gpt_oss", "llama4_text", "xglm") if name in FAMILIES]


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(42)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("backend", ["cpu_sdpa", "torch_reference"])
@pytest.mark.parametrize("family", ISSUE42)
def test_preempted_chunked_batch_matches_hf(family, backend, tiny_model, hf_reference):
    fam = FAMILIES[family]
    opt = optimize(tiny_model(family, fam.impls[-1]), attention_backend=backend, block_size=4,
                   num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16)
    prompts = _prompts()
    got = opt.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert opt.engine.metrics.preemptions > 0, "the pool was large enough for every request: nothing preempted"
    for prompt, n, tokens in zip(prompts, NEW_TOKENS, got):
        want = hf_reference.greedy(family, prompt, n)
        if tokens != want:
            first = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
            pytest.fail(f"{family}/{backend}: prompt of {len(prompt)} tokens diverges from HF greedy at new token "
                        f"{first}: {tokens[first:first + 5]} vs HF {want[first:first + 5]}")
