"""Write a Hugging Face Llama-family causal LM as a llama.cpp GGUF file, for the llama.cpp bench peers.

    python bench/gguf_export.py [--dir ~/.cache/devin_compile/gguf]   # SmolLM2-135M → F32, F16, BF16, Q4_1

Only for benchmarks: the files go to a cache outside the repository, are written once and reused.
Our own writer over the ``gguf`` package's ``GGUFWriter``: llama.cpp's tensor names (token_embd,
blk.N.attn_q ..., output_norm, output), llama.cpp's rotary layout for the q/k projections (HF keeps
the two rotated halves of a head apart, llama.cpp interleaves them in pairs), the GPT-2 style BPE
vocabulary and merges of the HF tokenizer. A quantized file (Q4_1, ...) is made from the F32 one by
llama.cpp itself (``llama_cpp.llama_model_quantize``), as ``llama-quantize`` would.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

CACHE = Path(os.environ.get("DEVIN_GGUF_CACHE", Path.home() / ".cache" / "devin_compile" / "gguf"))
FLOAT_TYPES = ("f32", "f16", "bf16")
LAYER_NAMES = {  # HF name inside model.layers.N → llama.cpp name inside blk.N
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def rope_interleave(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF q/k rows (per head: first halves, then second halves) → llama.cpp's (pairs side by side)."""
    out, *rest = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, *rest).transpose(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str | None:
    """The llama.cpp tensor name of an HF Llama parameter (None: not written, e.g. rotary buffers)."""
    name = hf_name.removesuffix(".weight")
    if name == "model.embed_tokens":
        return "token_embd.weight"
    if name == "model.norm":
        return "output_norm.weight"
    if name == "lm_head":
        return "output.weight"
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}.weight"
    return None


def gguf_tensors(model):
    """(llama.cpp name, float32 tensor) of every weight, q/k rows in llama.cpp's rotary layout."""
    cfg = model.config
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    tied = getattr(cfg, "tie_word_embeddings", False)
    for hf_name, p in model.state_dict().items():
        name = gguf_name(hf_name)
        if name is None or (tied and name == "output.weight"):
            continue
        w = p.detach().float().cpu()
        kind = name.split(".")[-2]
        if kind in heads:
            w = rope_interleave(w, heads[kind])
        yield name, w


def _encode(w: torch.Tensor, ftype: str):
    """(array, raw ggml type or None) to store ``w`` as ``ftype``; 1-D tensors (norms) stay F32."""
    import gguf

    if w.dim() == 1 or ftype == "f32":
        return w.numpy().astype(np.float32), None
    if ftype == "f16":
        return w.numpy().astype(np.float16), None
    return gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16


def rope_theta(cfg) -> float:
    """The rotary base: ``rope_parameters`` (transformers 5) or ``rope_theta``; only plain RoPE is exported."""
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rp['rope_type']!r} is not exported (only the default RoPE)")
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _add_config(writer, model, ftype: str) -> None:
    """The llama.* hyper-parameters llama.cpp reads."""
    import gguf

    cfg = model.config
    writer.add_name(getattr(cfg, "_name_or_path", "") or "model")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    ft = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
          "bf16": gguf.LlamaFileType.MOSTLY_BF16}[ftype]
    writer.add_file_type(ft)


def _add_tokenizer(writer, tokenizer, vocab_size: int, pre: str) -> None:
    """The HF fast tokenizer's byte-level BPE as ``tokenizer.ggml.*`` (model gpt2)."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    by_id = {i: t for t, i in vocab.items()} | {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.CONTROL if i in special else
                     gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, tid in ((writer.add_bos_token_id, tokenizer.bos_token_id),
                        (writer.add_eos_token_id, tokenizer.eos_token_id),
                        (writer.add_unk_token_id, tokenizer.unk_token_id),
                        (writer.add_pad_token_id, tokenizer.pad_token_id)):
        if tid is not None:
            setter(tid)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)


def export_gguf(model, tokenizer, path: str | Path, ftype: str = "f32", pre: str = "smollm") -> Path:
    """Write ``model`` (a Llama-architecture HF causal LM) and its tokenizer as a GGUF file."""
    import gguf

    if ftype not in FLOAT_TYPES:
        raise ValueError(f"ftype {ftype!r}: one of {FLOAT_TYPES} (quantize the f32 file for others)")
    if model.config.model_type not in ("llama", "mistral"):
        raise ValueError(f"only Llama-architecture models are exported, not {model.config.model_type!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    _add_config(writer, model, ftype)
    _add_tokenizer(writer, tokenizer, model.config.vocab_size, pre)
    for name, w in gguf_tensors(model):
        data, raw = _encode(w, ftype)
        writer.add_tensor(name, data, raw_dtype=raw) if raw is not None else writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def quantize_gguf(src: str | Path, dst: str | Path, ftype: str = "Q4_1", threads: int = 0) -> Path:
    """llama.cpp's own quantizer (``llama_model_quantize``) from ``src`` into ``dst``, e.g. Q4_1."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = threads
    tmp = Path(dst).with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} → {ftype}) returned {rc}")
    tmp.replace(dst)
    return Path(dst)


def smollm2_ggufs(kinds=("f32", "f16", "bf16", "q4_1"), cache: Path = CACHE) -> dict[str, Path]:
    """The embedded SmolLM2-135M as GGUF files in ``cache`` (written on first use): {kind: path}."""
    from devin_compile.models import load_model

    paths = {k: cache / f"SmolLM2-135M.{k.upper()}.gguf" for k in kinds}
    floats = [k for k in kinds if k in FLOAT_TYPES] + (["f32"] if set(kinds) - set(FLOAT_TYPES) else [])
    if any(not (cache / f"SmolLM2-135M.{k.upper()}.gguf").exists() for k in floats):
        model, tok = load_model(None, torch.float32)
        for k in dict.fromkeys(floats):
            p = cache / f"SmolLM2-135M.{k.upper()}.gguf"
            if not p.exists():
                export_gguf(model, tok, p, k)
    for k in kinds:
        if k not in FLOAT_TYPES and not paths[k].exists():
            quantize_gguf(cache / "SmolLM2-135M.F32.gguf", paths[k], k)
    return paths


def main() -> None:
    """Write (or find) the SmolLM2 GGUF files and print their paths."""
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=CACHE)
    ap.add_argument("--kinds", nargs="*", default=["f32", "f16", "bf16", "q4_1"])
    args = ap.parse_args()
    for kind, p in smollm2_ggufs(tuple(args.kinds), args.dir).items():
        print(f"{kind}: {p} ({p.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
