"""bench/gguf_export.py: a tiny seeded Llama written as GGUF reads back the same, in transformers and llama.cpp."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from gguf_export import export_gguf, gguf_name, rope_interleave, rope_theta  # noqa: E402


def _tokenizer():
    """A byte-level BPE tokenizer built in memory: the 256 byte symbols, 3 merges, 2 special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1} | {c: i + 2 for i, c in enumerate(alphabet)}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    return tok, len(vocab)


def _model(vocab: int):
    """A 2-layer GQA Llama (4 query heads, 2 KV heads), seeded, weights scaled up so greedy has no near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=50000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    assert rope_theta(model.config) == 50000.0  # not the default base: the export must carry it
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok, vocab = _tokenizer()
    model = _model(vocab)
    path = export_gguf(model, tok, tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf", "f32")
    return model, path


def test_rope_interleave_pairs_the_halves_of_each_head():
    w = torch.arange(8.0).reshape(8, 1)  # 2 heads of 4 rows: per head [a0 a1 b0 b1]
    assert rope_interleave(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_names():
    assert gguf_name("model.layers.3.self_attn.k_proj.weight") == "blk.3.attn_k.weight"
    assert gguf_name("model.layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("model.rotary_emb.inv_freq") is None


def test_transformers_reads_the_export_back(exported):
    from transformers import AutoModelForCausalLM

    model, path = exported
    back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 70, 90, 120, 7, 33]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_llama_cpp_greedy_matches_hf(exported):
    llama_cpp = pytest.importorskip("llama_cpp")
    model, path = exported
    ids = [1, 40, 70, 90, 120, 7, 33]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False)
    got = []
    for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        got.append(t)
        if len(got) == len(ref):
            break
    assert got == ref
