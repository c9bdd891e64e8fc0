"""Capture holes: encoder (bidirectional) models are refused, not compiled as causal; and
``optimize()`` does not print torch's LeafSpec FutureWarning.

Before: a BERT-style model built with ``is_decoder=False`` (``BertLMHeadModel``,
``RobertaForCausalLM``, ...) has a ``logits_to_keep`` head and captures fine, but its
attention sees every token both ways; the paged runtime would have served it as causal.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (BertConfig, BertLMHeadModel, LlamaConfig, LlamaForCausalLM, RobertaConfig,
                          RobertaForCausalLM)

import devin_compile as dc
from devin_compile import UnsupportedModelError
from devin_compile.capture import capture, model_info

_SMALL = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
_CAUSE_AND_WAY_OUT = r"bidirectional \(encoder\) attention, which is not causal.*AutoModelForCausalLM"


def _bert(is_decoder: bool, attn_implementation: str = "sdpa") -> BertLMHeadModel:
    torch.manual_seed(0)
    cfg = BertConfig(is_decoder=is_decoder, **_SMALL)
    cfg._attn_implementation = attn_implementation
    return BertLMHeadModel(cfg).eval()


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256)).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_bert_encoder_is_refused_with_cause_and_way_out(attn_implementation):
    bert = _bert(is_decoder=False, attn_implementation=attn_implementation)
    with pytest.raises(UnsupportedModelError, match=r"BertLMHeadModel \(model_type 'bert'\).*" + _CAUSE_AND_WAY_OUT):
        model_info(bert)
    with pytest.raises(UnsupportedModelError, match=_CAUSE_AND_WAY_OUT):
        capture(bert)
    with pytest.raises(UnsupportedModelError, match=_CAUSE_AND_WAY_OUT):
        dc.optimize(bert)


def test_roberta_causal_lm_class_with_encoder_config_is_refused():
    torch.manual_seed(0)
    roberta = RobertaForCausalLM(RobertaConfig(is_decoder=False, **_SMALL)).eval()
    with pytest.raises(UnsupportedModelError, match=r"RobertaForCausalLM \(model_type 'roberta'\).*not causal"):
        model_info(roberta)


def test_bert_decoder_keeps_being_accepted():
    info = model_info(_bert(is_decoder=True))
    assert info.model_type == "bert"
    assert info.sliding_windows == {"m.bert.encoder.layer.0.attention.self": -1}


def test_causal_tiny_model_still_accepted(tiny_model):
    for family in ("llama", "gpt2", "gpt_neox"):  # gpt_neox's config says is_decoder=False, yet it is causal
        info = model_info(tiny_model(family, "sdpa"))
        assert len(info.attention_modules) == 2
        assert set(info.sliding_windows.values()) == {-1}


def test_optimize_emits_no_leafspec_future_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dc.optimize(_tiny_llama(), max_model_len=32, num_kv_blocks=8, block_size=4)
    leaf = [w for w in caught if issubclass(w.category, FutureWarning) and "LeafSpec" in str(w.message)]
    assert not leaf, [str(w.message) for w in leaf]
