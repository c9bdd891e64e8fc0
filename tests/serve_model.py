"""A tiny seeded Llama with SmolLM2's real tokenizer (byte-level BPE, chat template) for the
server tests: the tokenizer is read from the embedded GGUF (or its converted cache), so
nothing is downloaded. ``tiny_chat_folder(path)`` saves model + tokenizer as an HF folder
(for ``devin-compile serve --model``); ``tiny_chat_opt()`` optimizes it in-process.

The output head is set so that greedy decoding replays :data:`REPLAY` (each of its tokens
predicts the next, cyclically): a prompt ending inside it continues with known multi-byte
text whose characters are split across byte-level tokens. Other tokens keep random weights.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

REPLAY = " 日本語の 🙂 café ñandú ½ naïve"  # no token repeats in it (each has one successor)


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from devin_compile.models import _cache_dir, smollm2_gguf_path

    cached = _cache_dir() / "SmolLM2-135M-Instruct.Q4_1-hf"
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@functools.lru_cache(maxsize=None)
def tiny_chat_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm2_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False, initializer_range=0.05)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    ids = tok(REPLAY, add_special_tokens=False)["input_ids"]
    assert len(set(ids)) == len(ids)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        for a, b in zip(ids, ids[1:] + ids[:1]):
            head[b] = 10.0 / cfg.hidden_size ** 0.5 * emb[a] / emb[a].norm()  # logit ~10: greedy follows, sampling rarely
    return model


def tiny_chat_folder(folder: Path) -> Path:
    tiny_chat_model().save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def tiny_chat_opt(**options):
    from devin_compile import optimize

    return optimize(tiny_chat_model(), tokenizer=smollm2_tokenizer(), **options)
