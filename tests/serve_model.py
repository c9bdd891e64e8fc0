"""A tiny seeded Llama with SmolLM2's real tokenizer (byte-level BPE, chat template) for the
server tests: the tokenizer is read from the embedded GGUF (or its converted cache), so
nothing is downloaded. ``tiny_chat_folder(path)`` saves model + tokenizer as an HF folder
(for ``devin-compile serve --model``); ``tiny_chat_opt()`` optimizes it in-process.
``running_server``, ``openai_client``, ``post`` and ``metrics`` talk to a server under test.

The output head is set so that greedy decoding replays :data:`REPLAY` (each of its tokens
predicts the next, cyclically): a prompt ending inside it continues with known multi-byte
text whose characters are split across byte-level tokens. Other tokens keep random weights.
"""
from __future__ import annotations

import contextlib
import functools
import json
import urllib.error
import urllib.request
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


@contextlib.contextmanager
def running_server(opt, model_name: str, tracing=None, **options):
    """A :class:`~devin_compile.serve.app.Server` (``options``: its keyword arguments) on 127.0.0.1
    (an ephemeral port), ``.url`` set."""
    from devin_compile.serve.app import Server
    from devin_compile.serve.server import BackgroundServer

    srv = Server(opt, model_name, **options)
    if tracing is not None:
        srv.tracing = tracing
    with BackgroundServer(srv) as bg:
        srv.url = bg.url
        yield srv


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def post(server, path: str, body, raw: bool = False, headers: dict | None = None):
    """(status, headers, JSON body) of a POST (a GET when ``body`` is None); ``raw``: ``body`` is sent
    as given (bytes); ``headers``: sent as well."""
    data = body if raw or body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def metrics(server) -> dict[str, float]:
    """``/metrics`` as {sample name with labels: value}."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
