"""Bad input fails early, clearly, and alone.

Unsupported models and invalid options raise before any capture work; a bad request is
rejected at ``add_request`` without disturbing the others; a request the pool can never
hold fails with a KV-cache-exhausted message while its neighbours complete.
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import (BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, LlamaModel, T5Config,
                          T5ForConditionalGeneration)

import devin_compile as dc
import devin_compile.api as api
from devin_compile import RequestError, SamplingParams, UnsupportedModelError
from devin_compile.runtime.sequence import Status

VOCAB = 256
MAX_LEN = 32
BLOCK = 4
NUM_BLOCKS = 6  # 24 KV slots: less than the 32-token context, so the pool bound bites first



def llama_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def opt(model):
    return dc.optimize(model, max_model_len=MAX_LEN, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)


@pytest.fixture
def engine(opt):
    """The module's engine, checked to be idle and leak-free around each test."""
    e = opt.engine
    assert not e.has_unfinished() and e.kv.allocator.num_used == 0
    yield e
    for rid, seq in list(e.requests.items()):
        e.abort(rid)
    assert e.kv.allocator.num_used == 0


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(length)]


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if optimize() gets as far as inspecting or capturing the model."""

    def boom(*a, **k):
        raise AssertionError("optimize() started work before rejecting its input")

    monkeypatch.setattr(api, "capture", boom)
    monkeypatch.setattr(api, "model_info", boom)


# ----------------------------------------------------------------------------------------
# Unsupported models


def test_encoder_only_masked_lm_is_unsupported():
    bert = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64)).eval()
    with pytest.raises(UnsupportedModelError, match=r"BertForMaskedLM.*logits_to_keep.*AutoModelForCausalLM"):
        dc.optimize(bert)


def test_encoder_decoder_is_unsupported():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                             num_heads=2)).eval()
    with pytest.raises(UnsupportedModelError, match=r"T5ForConditionalGeneration is an encoder-decoder.*decoder-only"):
        dc.optimize(t5)


def test_base_model_without_lm_head_is_unsupported():
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModelError, match=r"LlamaModel.*not a causal-LM head model"):
        dc.optimize(LlamaModel(llama_config()).eval())


@pytest.mark.parametrize("module", [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Embedding(10, 4))])
def test_plain_module_is_unsupported(module):
    with pytest.raises(UnsupportedModelError, match=r"not a Hugging Face PreTrainedModel.*AutoModelForCausalLM"):
        dc.optimize(module)


def test_unsupported_model_fails_before_capture(monkeypatch):
    called = []
    monkeypatch.setattr(api, "capture", lambda *a, **k: called.append(1))
    with pytest.raises(UnsupportedModelError):
        dc.optimize(torch.nn.Linear(2, 2))
    assert not called


# ----------------------------------------------------------------------------------------
# Invalid options: ValueError before any work


@pytest.mark.parametrize("options, message", [
    ({"blok_size": 16}, r"unknown option 'blok_size'.*block_size"),
    ({"verfy": True}, r"unknown option 'verfy'"),
    ({"block_size": 0}, r"block_size=0 must be a positive power of two"),
    ({"block_size": 6}, r"block_size=6 must be a positive power of two"),
    ({"block_size": -4}, r"power of two"),
    ({"block_size": "16"}, r"power of two"),
    ({"num_kv_blocks": 0}, r"num_blocks=0"),
    ({"kv_cache_memory": -1}, r"kv_cache_memory=-1 must be a positive"),
    ({"kv_cache_memory": 0}, r"kv_cache_memory=0"),
    ({"kv_cache_fraction": 1.5}, r"kv_cache_fraction=1.5"),
    ({"kv_cache_fraction": 0}, r"kv_cache_fraction=0"),
    ({"dtype": "float8"}, r"dtype='float8' is not supported"),
    ({"dtype": "int4"}, r"dtype='int4'"),
    ({"dtype": 3}, r"dtype=3"),
    ({"attention_backend": "warp_speed"}, r"attention_backend='warp_speed' is unknown; valid: \[.*torch_reference"),
    ({"device": "not-a-device"}, r"device='not-a-device'"),
    ({"max_num_seqs": 0}, r"max_num_seqs=0"),
    ({"max_num_batched_tokens": -8}, r"max_num_batched_tokens=-8"),
    ({"max_model_len": 1}, r"max_model_len=1"),
])
def test_invalid_options_raise_before_any_work(no_work, options, message):
    with pytest.raises(ValueError, match=message):
        dc.optimize(tiny_llama(), **options)


def test_kv_budget_smaller_than_one_block_is_a_value_error():
    with pytest.raises(ValueError, match=r"smaller than one block"):
        dc.optimize(tiny_llama(), kv_cache_memory=10, block_size=BLOCK)


# ----------------------------------------------------------------------------------------
# Invalid requests fail alone


def test_prompt_longer_than_context_fails_only_that_request(engine, model):
    good = prompt_of(5, 1)
    rid = engine.add_request(good, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=rf"prompt has {MAX_LEN} tokens but the model's context is {MAX_LEN}"):
        engine.add_request(prompt_of(MAX_LEN, 2), SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match=rf"= 40 tokens exceeds the model's context of {MAX_LEN}"):
        engine.add_request(prompt_of(20, 3), SamplingParams(max_new_tokens=20))
    assert list(engine.requests) == [rid]  # the rejected requests left no trace
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[rid].output_ids == hf_greedy(model, good, 4)


def test_request_larger_than_the_whole_pool_is_rejected_at_add(engine):
    pool = NUM_BLOCKS * BLOCK
    assert pool < MAX_LEN
    with pytest.raises(ValueError, match=rf"needs {pool + 1} KV slots but the whole KV pool holds {pool}"):
        engine.add_request(prompt_of(10, 4), SamplingParams(max_new_tokens=pool + 1 - 10))
    engine.add_request(prompt_of(10, 4), SamplingParams(max_new_tokens=pool - 10))  # exactly fits
    while engine.has_unfinished():
        engine.step()


def test_generate_with_one_bad_prompt_raises_and_leaves_nothing_queued(opt):
    with pytest.raises(ValueError, match=r"prompt 1: .*context"):
        opt.generate([prompt_of(4, 5), prompt_of(MAX_LEN + 3, 6), prompt_of(4, 7)], max_new_tokens=2)
    assert not opt.engine.has_unfinished()
    assert opt.engine.kv.allocator.num_used == 0


def test_engine_generate_with_one_bad_prompt_leaves_nothing_queued(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([prompt_of(4, 5), [], prompt_of(4, 7)], SamplingParams(max_new_tokens=2))
    assert not engine.has_unfinished()
    assert engine.kv.allocator.num_used == 0
    assert engine.step() == []


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, r"temperature=-0.5 must be >= 0"),
    ({"top_p": 0}, r"top_p=0 must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5"),
    ({"top_k": -1}, r"top_k=-1 must be an integer >= 0"),
    ({"max_new_tokens": 0}, r"max_new_tokens=0 must be a positive integer"),
    ({"max_new_tokens": -3}, r"max_new_tokens=-3"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens=2.5"),
    ({"max_new_tokens": True}, r"max_new_tokens=True"),
    ({"seed": "seven"}, r"seed='seven'"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids=\[-1\]"),
    ({"logits_processors": [3]}, r"logits_processors must be callables"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_invalid_sampling_params_through_generate(opt):
    with pytest.raises(ValueError, match="temperature"):
        opt.generate([[5, 6, 7]], do_sample=True, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        opt.generate([[5, 6, 7]], max_new_tokens=0)
    assert not opt.engine.has_unfinished()


def test_params_must_be_sampling_params(engine):
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.add_request([5, 6], {"max_new_tokens": 3})


@pytest.mark.parametrize("prompt", [[5, VOCAB], [-1, 5], [5, 1.5], [5, True], [5, "7"], torch.tensor([3, VOCAB + 9])])
def test_token_ids_outside_the_vocab(engine, prompt):
    before = dict(engine.requests)
    with pytest.raises(ValueError, match=rf"prompt token ids must be integers in \[0, {VOCAB}\)"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    assert engine.requests == before and not engine.has_unfinished()


@pytest.mark.parametrize("prompt", [[], (), torch.tensor([], dtype=torch.long)])
def test_empty_prompt(engine, prompt):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=2))


def test_text_prompt_without_tokenizer(engine):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("hello", SamplingParams(max_new_tokens=2))


def test_generate_tensor_input_checks(opt):
    with pytest.raises(ValueError, match=r"input_ids must be a \[B, T\]"):
        opt.generate(input_ids=torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask shape"):
        opt.generate(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="either prompts or input_ids"):
        opt.generate([[1, 2]], input_ids=torch.ones(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        opt.generate([[4, 5], [6, 7]], max_new_tokens=[3])


def test_paged_graph_outside_a_step_context(opt):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(RuntimeError, match=r"outside a runtime step.*step_context"):
        opt.program.main(ids, torch.arange(3)[None], torch.tensor([2]))


# ----------------------------------------------------------------------------------------
# A request that can never fit the (shared) pool fails alone, mid-run


def test_request_that_can_never_fit_fails_while_others_complete(engine, model):
    # Half the pool is held outside the scheduler (as OptimizedModel.__call__ does while it
    # runs a full-sequence forward), so 3 blocks = 12 slots remain for the engine.
    held = engine.kv.allocator.allocate(NUM_BLOCKS // 2)
    try:
        small = prompt_of(3, 8)
        big = prompt_of(8, 9)  # 8 + 10 tokens fit the nominal pool (24) but never the 12 slots left
        r_small = engine.add_request(small, SamplingParams(max_new_tokens=4, ignore_eos=True))
        r_big = engine.add_request(big, SamplingParams(max_new_tokens=10, ignore_eos=True))
        r_after = engine.add_request(small[::-1], SamplingParams(max_new_tokens=3, ignore_eos=True))
        for _ in range(200):
            if not engine.has_unfinished():
                break
            engine.step()
            assert engine.kv.allocator.num_used <= NUM_BLOCKS
        big_seq = engine.requests[r_big]
        assert big_seq.status is Status.FAILED and big_seq.finish_reason == "error"
        assert "KV cache exhausted" in big_seq.error and "num_kv_blocks" in big_seq.error
        assert big_seq.block_table == []
        assert 0 < len(big_seq.output_ids) < 10  # it ran, then ran out mid-decode
        assert engine.requests[r_small].output_ids == hf_greedy(model, small, 4)
        assert engine.requests[r_after].output_ids == hf_greedy(model, small[::-1], 3)
        with pytest.raises(RequestError, match="KV cache exhausted"):
            list(engine.stream(r_big))
        assert engine.kv.allocator.num_used == len(held)
    finally:
        engine.kv.allocator.free(held)


def test_generate_reports_the_failed_request_with_the_others_results(opt, model):
    held = opt.engine.kv.allocator.allocate(NUM_BLOCKS // 2)
    try:
        with pytest.raises(RequestError, match="KV cache exhausted") as ei:
            opt.generate([prompt_of(3, 10), prompt_of(8, 11)], max_new_tokens=[4, 10], ignore_eos=True)
    finally:
        opt.engine.kv.allocator.free(held)
    ok, bad = ei.value.results
    assert ok.error is None and ok.output_ids == hf_greedy(model, prompt_of(3, 10), 4)
    assert bad.error and "KV cache exhausted" in bad.error
    assert opt.engine.kv.allocator.num_used == 0


# ----------------------------------------------------------------------------------------
# Empty input: a clear ValueError, never a raw reshape error or a silent empty result


@pytest.mark.parametrize("input_ids", [torch.zeros(1, 0), torch.zeros(1, 0, dtype=torch.long),
                                       torch.zeros(3, 0, dtype=torch.long)])
def test_call_with_an_empty_sequence(opt, input_ids):
    with pytest.raises(ValueError, match=r"empty sequence has no positions.*at least one token"):
        opt(input_ids)
    assert opt.engine.kv.allocator.num_used == 0


def test_call_with_an_empty_batch(opt):
    with pytest.raises(ValueError, match=r"shape \(0, 3\): an empty batch.*at least one row"):
        opt(torch.zeros(0, 3, dtype=torch.long))


def test_call_with_a_fully_masked_row(opt):
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match=r"row 1 of input_ids has no tokens under attention_mask"):
        opt(ids, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    assert opt.engine.kv.allocator.num_used == 0


def test_generate_on_an_empty_batch_raises_like_hf(opt):
    with pytest.raises(ValueError, match=r"empty batch \(no prompts\)"):
        opt.generate([])
    with pytest.raises(ValueError, match=r"empty batch"):
        opt.generate(input_ids=torch.zeros(0, 3, dtype=torch.long))
    assert not opt.engine.has_unfinished()


@pytest.mark.parametrize("prompts, index", [([[]], 0), ([[5, 6], []], 1), ([[5], [6], ()], 2)])
def test_generate_with_an_empty_prompt_in_the_batch(opt, prompts, index):
    with pytest.raises(ValueError, match=rf"prompt {index}: empty prompt: give at least one token"):
        opt.generate(prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 0: empty prompt"):
        opt.generate(input_ids=torch.zeros(1, 0, dtype=torch.long))
    assert not opt.engine.has_unfinished() and opt.engine.kv.allocator.num_used == 0


def test_engine_forward_logits_checks_and_returns_its_blocks(engine, model):
    ids = prompt_of(6, 12)
    got = engine.forward_logits(ids)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got.float().cpu(), want, atol=1e-4, rtol=1e-4)
    assert engine.kv.allocator.num_used == 0
    with pytest.raises(ValueError, match="empty prompt"):
        engine.forward_logits([])
    with pytest.raises(ValueError, match=r"prompt token ids must be integers"):
        engine.forward_logits([5, VOCAB])
    assert engine.kv.allocator.num_used == 0
