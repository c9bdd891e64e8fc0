"""Batch-1 decode against the memory roofline and the peers, all in one process, repeats interleaved.

    python bench/decode_peers.py [--new-tokens 128] [--repeats 5] [--base OPTION=VALUE ...] [--no-int4]
                                 [--no-llama-cpp] [--out bench/results/decode_peers.json]

Engines (SmolLM2-135M, greedy, EOS ignored, 32-token prompt, same torch threads):
  devin bf16          optimize() defaults on the bf16 model;
  devin INT4 g32      the bf16 model with INT4 weights, RTN at group 32 (the blocks of the shipped Q4_1 GGUF,
                      whose dequantized weights the model is), the (tied) output head in INT8 (the default,
                      ``lm_head="int8"``; the GGUF's head is Q8_0: the like-for-like row);
  devin INT4 g32 bf16 head  the same with the head kept in bf16 (``lm_head=False``);
  devin INT4 g32 +head  the same with the head in INT4 too (``lm_head="int4"``);
  ... (base)          the same built with ``--base`` options (a before/after of a change in one run);
  HF eager bf16/fp32  ``generate`` on the model in both dtypes (its best one is the peer);
  llama.cpp Q4_1/F16/BF16  llama-cpp-python on GGUF exports of the same weights (bench/gguf_export.py,
                      cached outside the repo; Q4_1 made by llama.cpp's quantizer), ``n_threads`` = torch's
                      threads (bench/llama_cpp_peer.py; the ``bench`` extra, skipped with a note when it is
                      not installed). Their greedy tokens on the F32 export are checked against HF fp32's.
Each engine's decode tokens/s is the median over ``--repeats`` rounds (A, B, C, ... per round) of
(new tokens - 1) / (time after the first token). Bytes read per token: the tensors the decode graph
holds + the KV cache read at the mean context (devin); the GGUF's tensor bytes (llama.cpp); the
model's parameters (HF). Read bandwidth is measured in the same run (256 MiB reduction).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile.benchmarking import cpu_info, hf_decode_round, parse_options, read_bandwidth, time_devin_decodes  # noqa: E402,E501
from devin_compile.models import load_model  # noqa: E402
from devin_compile.weights import held_bytes, held_tensors  # noqa: E402
from llama_cpp_peer import llama_cpp_peers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "..", "shared", "data", "tinyshakespeare.txt")
# RTN weights do not depend on calibration (its statistics only feed the report): the smallest one, since
# calibrating the bf16 model with its backward pass took minutes per engine on an AVX2 CPU (no native bf16)
INT4 = {"method": "rtn", "group_size": 32, "calib_chunks": 1, "calib_len": 64, "progress": False}


def hf_round(model, ids: list[int], new_tokens: int):
    """One HF ``generate`` round → decode tokens/s (the time after the first token), and its tokens."""
    x = torch.tensor([ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=model.config.pad_token_id or 0)
    out = {}

    def run() -> float:
        rate, _ttft, y = hf_decode_round(model, x, new_tokens, **kw)
        out["tokens"] = y[0, len(ids):].tolist()
        return rate
    run()  # warm-up
    return run, out


def peer_ratios(rate: dict[str, float]) -> dict[str, float]:
    """devin / llama.cpp decode rates at like precision, for the pairs this run timed."""
    pairs = [("devin INT4 g32", "llama.cpp Q4_1"), ("devin INT4 g32 bf16 head", "llama.cpp Q4_1"),
             ("devin INT4 g32 +head", "llama.cpp Q4_1"),
             ("devin bf16", "llama.cpp BF16"), ("devin bf16", "llama.cpp F16")]
    return {f"{a} / {b}": rate[a] / rate[b] for a, b in pairs if a in rate and b in rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base", nargs="*", default=[], metavar="OPTION=VALUE")
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode_peers.json"))
    args = ap.parse_args()
    base = parse_options(args.base)
    mach = cpu_info()
    bw = read_bandwidth()
    model, tok = load_model(None, torch.bfloat16)
    ids = tok(open(TEXT).read()[:400], add_special_tokens=False)["input_ids"][:32]
    variants = [("devin bf16", {})] + ([] if args.no_int4 else [
        ("devin INT4 g32", {"quantization": INT4}),
        ("devin INT4 g32 bf16 head", {"quantization": {**INT4, "lm_head": False}}),
        ("devin INT4 g32 +head", {"quantization": {**INT4, "lm_head": "int4"}})])
    opts, nbytes = {}, {}
    for name, kw in variants:
        for label, extra in ([(f"{name} (base)", base)] if base else []) + [(name, {})]:
            opt = devin_compile.optimize(model, tokenizer=tok, **kw, **extra)
            opts[label] = opt
            graph = opt.engine.runner.program.graphs.get("decode") or opt.engine.runner.program.graphs["main"]
            kv = opt.engine.runner.kv_cache.spec.bytes_per_token * (len(ids) + args.new_tokens / 2)
            nbytes[label] = held_bytes(held_tensors(graph)) + kv
    hf32, _ = load_model(None, torch.float32)
    others, tokens, notes = {}, {}, {}
    for label, m in (("HF eager bf16", model), ("HF eager fp32", hf32)):
        others[label], tokens[label] = hf_round(m, ids, args.new_tokens)
        nbytes[label] = sum(p.numel() * p.element_size() for p in m.parameters())
    if not args.no_llama_cpp:
        fns, outs, gbs, notes = llama_cpp_peers(ids, args.new_tokens, torch.get_num_threads(),
                                                tokens["HF eager fp32"]["tokens"])
        others.update(fns)
        tokens.update(outs)
        nbytes.update(gbs)
    print(f"{mach['cpu']} ({', '.join(mach['isa'])}), {mach['threads']} threads, load {mach['loadavg']}, "
          f"OMP_WAIT_POLICY={mach['omp_wait_policy']}; read bandwidth {bw / 1e9:.1f} GB/s; {notes}", flush=True)
    timings = time_devin_decodes(opts, ids, args.new_tokens, args.repeats, others=others)
    rate = {t.name: t.decode_tok_s for t in timings}
    hf_best = max(rate["HF eager bf16"], rate["HF eager fp32"])
    rows = []
    for t in timings:
        toks = t.tokens or tokens.get(t.name, {}).get("tokens", [])
        r = {"engine": t.name, "decode_tok_s": t.decode_tok_s, "bytes_per_token": nbytes[t.name],
             "read_roofline_share": nbytes[t.name] * t.decode_tok_s / bw, "vs_hf_best": t.decode_tok_s / hf_best,
             "same_greedy_tokens_as_devin_bf16": toks == timings[0].tokens}
        if "llama.cpp Q4_1" in rate:
            r["vs_llama_cpp"] = t.decode_tok_s / rate["llama.cpp Q4_1"]
        rows.append(r)
    ratios = peer_ratios(rate)
    print("\n| engine | decode tok/s | MB read/token | share of read roofline | vs HF best | vs llama.cpp | "
          "greedy = devin bf16 |\n|---|---|---|---|---|---|---|")
    for r in rows:
        vs_ll = f"{r['vs_llama_cpp']:.2f}x" if "vs_llama_cpp" in r else "-"
        print(f"| {r['engine']} | {r['decode_tok_s']:.1f} | {r['bytes_per_token'] / 1e6:.1f} | "
              f"{r['read_roofline_share']:.0%} | {r['vs_hf_best']:.2f}x | {vs_ll} | "
              f"{r['same_greedy_tokens_as_devin_bf16']} |")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "machine": mach, "loadavg_end": os.getloadavg(),
                   "read_bandwidth_Bps": bw, "base_options": base, "notes": notes, "rows": rows, "ratios": ratios,
                   "median_of": args.repeats, "new_tokens": args.new_tokens, "prompt_tokens": len(ids)}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
